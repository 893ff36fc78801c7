"""The JAXLLM_* environment variables that tune kernels and loading, read once at import: a value
that does not parse is a ValueError naming its variable and value, not a bare `int()` error or a
garbage value silently taken for the default."""

from __future__ import annotations

import math
import os
import sys

# A number beyond this is no setting of any variable here, and would overflow the int it ends in
# (JAXLLM_LOAD_BUFFER_MB=1e308 times 2**20 is inf in float).
_LARGEST = 2**63
_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def _in_cli() -> bool:
    """Whether this process is the `jaxllm` command (its script, or `python -m jaxllm`)."""
    argv = getattr(sys, "orig_argv", sys.argv)
    return os.path.basename(sys.argv[0] if sys.argv else "") == "jaxllm" or \
        any(a == "-m" and b == "jaxllm" for a, b in zip(argv, argv[1:]))


def _refuse(message: str):
    """A ValueError naming the variable; in the `jaxllm` command, one line and exit code 2: the
    variables are read as jaxllm is imported, before the command's own error handling exists."""
    if _in_cli():
        print(f"jaxllm: error: {message}", file=sys.stderr)
        raise SystemExit(2)
    raise ValueError(message)


def env_number(name: str, default, kind=int):
    """$name as `kind` (int or float), `default` where it is unset; finite and below 2**63 in
    magnitude."""
    text = os.environ.get(name, str(default))
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None:  # refused outside the except: no "during handling" chain on the error
        _refuse(f"environment variable {name}={text!r} is not {'an integer' if kind is int else 'a number'}")
    if not math.isfinite(value):
        _refuse(f"environment variable {name}={text!r} is not a finite number")
    if abs(value) >= _LARGEST:
        _refuse(f"environment variable {name}={text!r} is out of range "
                f"(its magnitude must be below 2**63)")
    return value


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
        _refuse(f"environment variable {name}={text!r} is not a comma-separated list of "
                f"{count} integers (default {default!r})")
    return values


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """$name, one of `choices` (exactly as spelled there), `default` where it is unset or empty."""
    text = os.environ.get(name, "")
    if text == "":
        return default
    if text not in choices:
        _refuse(f"environment variable {name}={text!r} is not one of "
                f"{', '.join(repr(c) for c in choices)}")
    return text


def env_flag(name: str, default: bool) -> bool:
    """$name as an on/off switch: 1/true/yes/on or 0/false/no/off (any case), `default` where it
    is unset or empty."""
    text = os.environ.get(name, "")
    word = text.strip().lower()
    if word == "":
        return default
    if word in _ON or word in _OFF:
        return word in _ON
    _refuse(f"environment variable {name}={text!r} is not an on/off switch "
                f"(1/0, true/false, yes/no, on/off)")
