"""Argument checks, each named once: whole numbers in a range, numbers, float32-held numbers,
flags, token ids, and `argtype` for argparse. Every check returns the value as a plain Python
(or numpy int32) value, or raises one ValueError (a TypeError where a caller asks) naming it.

The bottom layer: it imports no other jaxllm module (nor JAX: scripts/bench.py loads it before
it sets JAX up), so config, cache, sampling, the CLI and the scripts all share it.
"""

import argparse
import math
import numbers

import numpy as np

INT32_MAX = 2 ** 31 - 1  # sizes, ids and windows become int32 on the device
FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32


def _scalar(value):
    """A numpy or JAX scalar (a 0-d array) as its Python value; anything else unchanged."""
    if hasattr(value, "ndim") and hasattr(value, "dtype") and hasattr(value, "item") and value.ndim == 0:
        return value.item()
    return value


def number(name: str, value) -> float:
    """`value` as a float, or a ValueError naming `name` where it is not one number: None, a
    string, a bool (True is no temperature or seed), an array of more than a scalar."""
    if isinstance(value, (str, bytes)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if isinstance(value, (bool, np.bool_)) or getattr(value, "dtype", None) == bool:
        raise ValueError(f"{name} must be a number, got {value!r} (a bool)")
    if hasattr(value, "ndim") and hasattr(value, "shape") and value.ndim != 0:
        raise ValueError(f"{name} must be a number, got an array of shape {value.shape}")
    try:
        return float(_scalar(value))
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None


def whole(name: str, value, least: int | None = None, most: int | None = INT32_MAX, *,
          floats: bool = True, kind_error: type = ValueError) -> int:
    """`value` as an int in [least, most] (None: unbounded): an int, a numpy/JAX integer scalar,
    or (with `floats`) a whole float; never a bool. A value of the wrong kind raises `kind_error`."""
    if isinstance(value, (bool, np.bool_)) or getattr(value, "dtype", None) == bool:
        raise kind_error(f"{name} must be an integer, got {value!r} (a bool)")
    if hasattr(value, "ndim") and hasattr(value, "shape") and value.ndim != 0:
        raise kind_error(f"{name} must be an integer, got an array of shape {value.shape}")
    x = _scalar(value)
    if floats and isinstance(x, float) and x.is_integer():
        x = int(x)
    if not isinstance(x, numbers.Integral):
        raise kind_error(f"{name} must be an integer, got {value!r}")
    x = int(x)
    if least is not None and x < least:
        raise ValueError(f"{name} must be >= {least}, got {value}")
    if most is not None and x > most:
        raise ValueError(f"{name} must be at most {most}, got {value}")
    return x


def finite(name: str, value, *, above: float | None = None, least: float | None = None,
           most: float | None = None) -> float:
    """`value` as a finite float within the bounds given (above: exclusive), else a ValueError."""
    x = number(name, value)
    if not (math.isfinite(x) and (above is None or x > above) and (least is None or x >= least)
            and (most is None or x <= most)):
        bounds = [b for b in (above is not None and f"> {above}", least is not None and f">= {least}",
                              most is not None and f"<= {most}") if b]
        raise ValueError(f"{name} must be a finite number {' and '.join(bounds)}".rstrip() + f", got {value!r}")
    return x


def float32(name: str, value: float, rule: str) -> float:
    """`value` where float32 holds it as a normal number (or 0): 1e39 would be inf there, 1e-46
    zero (a penalty divides by it); else a ValueError naming it and its `rule`."""
    with np.errstate(over="ignore", under="ignore"):
        held = float(np.float32(value))
    if value != 0 and not (math.isfinite(held) and abs(held) >= FLOAT32_TINY):
        raise ValueError(f"{name} must be {rule}, a normal float32 number (magnitude in "
                         f"[{FLOAT32_TINY:.7g}, {FLOAT32_MAX:.7g}]), got {value}")
    return value


def flag(name: str, value, *, kind_error: type = ValueError) -> bool:
    """`value` as a bool: True or False only, numpy's too (1 and a string "no" are refused)."""
    if not isinstance(value, (bool, np.bool_)):
        shown = "None" if value is None else f"{type(value).__name__} {value!r:.80}"
        raise kind_error(f"{name} must be True or False, got {shown}")
    return bool(value)


def _holds_bool(x) -> bool:
    """Whether nested lists or tuples hold a bool anywhere."""
    if isinstance(x, (list, tuple)):
        return any(_holds_bool(t) for t in x)
    return isinstance(x, (bool, np.bool_))


def _out_of_range(bad: int, vocab: int) -> ValueError:
    return ValueError(f"token id {bad} out of range: the vocabulary has {vocab} ids (0..{vocab - 1})")


def _id_array(tokens, vocab: int) -> np.ndarray:
    """A rectangular array of token ids in [0, vocab) as int32."""
    try:
        arr = np.asarray(tokens)
    except ValueError:  # numpy's "inhomogeneous shape"
        raise ValueError("token ids must be a rectangular array: the rows differ in length or hold "
                         "nested lists (generate pads rows of different lengths)") from None
    if arr.size == 0:  # numpy makes an empty list float64: its dtype says nothing
        return arr.astype(np.int32)
    if arr.dtype.kind in "iuO" and _holds_bool(tokens):  # numpy made a True among ints 1
        raise ValueError("token ids must be integers, got a bool among them (True would be token 1)")
    if arr.dtype == object and all(isinstance(t, int) and not isinstance(t, bool) for t in arr.flat):
        raise _out_of_range(max(arr.flat, key=abs), vocab)  # ints too large for any dtype: name one
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.min() < 0 or arr.max() >= vocab:
        raise _out_of_range(int(arr.min()) if arr.min() < 0 else int(arr.max()), vocab)
    return arr.astype(np.int32)


def _is_array(x) -> bool:
    """A numpy or JAX array (JAX is not imported here: scripts set its flags before importing it)."""
    return isinstance(x, np.ndarray) or not isinstance(x, np.generic) and hasattr(x, "__array__") \
        and hasattr(x, "ndim") and hasattr(x, "shape")


def _is_prompt(x) -> bool:
    return isinstance(x, (list, tuple)) or _is_array(x)


def token_ids(ids, vocab: int, *, ragged: bool = False, one: bool = False):
    """Token ids checked: integers (no bools: True would be token 1) in [0, vocab).

    By default: any rectangular array or nested list, returned as one int32 array.
    `ragged`: a [B, T] array or a list of prompts (each a flat list or 1-D array, lengths may
    differ), returned as a list of B int32 rows; a ValueError names the prompt at fault.
    `one`: one prompt (a list or 1-D array), returned as an int32 row."""
    if one:
        if not _is_prompt(ids):
            raise ValueError(f"ids must be one prompt's token ids, a list, got {type(ids).__name__}")
        if _is_array(ids) and ids.ndim != 1:
            raise ValueError(f"ids must be one prompt's token ids, a list, got an array of shape {ids.shape}")
        return token_ids([ids], vocab, ragged=True)[0]
    if not ragged:
        return _id_array(ids, vocab)
    if isinstance(ids, (list, tuple)) and (len(ids) == 0 or _is_prompt(ids[0])):
        rows = []
        for b, r in enumerate(ids):
            try:
                row = np.asarray(r) if _is_prompt(r) else None
            except ValueError:  # numpy's "inhomogeneous shape"
                raise ValueError(f"prompt {b} must be a flat list of token ids: it holds a nested list") \
                    from None
            if row is None or row.ndim != 1:
                got = type(r).__name__ if row is None else f"shape {row.shape}"
                raise ValueError(f"prompt {b} must be a list of token ids, got {got}")
            if isinstance(r, (list, tuple)) and row.dtype.kind in "iu":  # numpy made a True among ints 1
                j = next((j for j, t in enumerate(r) if isinstance(t, (bool, np.bool_))), None)
                if j is not None:
                    raise ValueError(f"token ids must be integers, got {r[j]!r} (a bool) at position {j} "
                                     f"of prompt {b}")
            rows.append(_id_array(row, vocab))
        return rows
    try:
        arr = np.asarray(ids)
    except ValueError:  # numpy's "inhomogeneous shape"
        raise ValueError("ids must be a [B, T] array or a list of token lists: it holds rows of "
                         "different shapes or a nested list") from None
    if arr.ndim != 2:
        raise ValueError(f"ids must be a [B, T] array or a list of token lists, got shape {arr.shape}")
    return list(_id_array(arr, vocab))


def argtype(least: int, most: int | None = None):
    """An argparse type: an integer in [least, most] (most None: no upper bound), refused with
    one line that argparse prefixes with the flag."""
    rule = f">= {least}" if most is None else f"in [{least}, {most}]" + (" (int32)" if most == INT32_MAX else "")

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:  # argparse would name this function ("invalid parse value")
            raise argparse.ArgumentTypeError(f"must be a whole number {rule}, got {text!r}") from None
        if value < least or most is not None and value > most:
            shown = text if len(text) < 30 else f"{text[:12]}... ({len(text)} digits)"
            raise argparse.ArgumentTypeError(f"must be {rule}, got {shown}")
        return value
    return parse
