"""The JAXLLM_* environment variables that tune kernels and loading, read once at import: a value
that does not parse is a ValueError naming its variable, not a bare `int()` error."""

from __future__ import annotations

import os


def env_number(name: str, default, kind=int):
    """$name as `kind` (int or float), `default` where it is unset."""
    text = os.environ.get(name, str(default))
    try:
        return kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"environment variable {name}={text!r} is not {what}") from None


def env_ints(name: str, default: str) -> tuple[int, ...]:
    """$name as a comma-separated list of as many integers as `default` (the same form), which
    stands where it is unset."""
    text = os.environ.get(name, default)
    count = len(default.split(","))
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        values = ()
    if len(values) != count:
        raise ValueError(f"environment variable {name}={text!r} is not a comma-separated list of "
                         f"{count} integers (default {default!r})")
    return values
