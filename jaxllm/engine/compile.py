"""Compile accounting on the generate path: warnings on surprise recompiles, and `kernel_view`.

`compile_count` / `check_recompile` are the hook around calls of jitted entry points: the first
compilation of a function for a model is expected, each later new shape gets one
`RecompileWarning` naming it. `kernel_view` asks `generate` for a loop whose kernels a profiler
records (tools/trace.py opens it around a trace).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Callable, Hashable

_KERNEL_VIEW = 0  # how many `kernel_view` blocks are open


@contextlib.contextmanager
def kernel_view():
    """Within this block `generate` runs a token loop whose decode kernels a profiler records:
    outside it, the whole loop is one CUDA graph (see generate.LOOP_GRAPH_OPTIONS), and the
    profiler shows no kernel of a step replayed inside it. The kernels are the same; the loop
    waits on the host between steps (1-3% slower for small models). `trace` and
    `trace_steady` open it themselves; open it around the warm-up calls before a `trace` too,
    or the first call in the trace compiles."""
    global _KERNEL_VIEW
    _KERNEL_VIEW += 1
    try:
        yield
    finally:
        _KERNEL_VIEW -= 1


def kernels_visible() -> bool:
    """Whether a `kernel_view` block is open."""
    return _KERNEL_VIEW > 0


# ----------------------------------------------------------------------------------------------
# Recompilation warnings


class RecompileWarning(UserWarning):
    """A jitted jaxllm function compiled again for a new shape in this process."""


_lock = threading.Lock()
_shapes: dict[tuple[str, Hashable], list[str]] = {}


def compile_count(fn) -> int | None:
    """How many compiled versions jitted `fn` holds now (None if this JAX cannot tell)."""
    size = getattr(fn, "_cache_size", None)
    try:
        return size() if size is not None else None
    except Exception:
        return None


def check_recompile(fn, before: int | None, name: str, describe: Callable[[], str],
                    group: Hashable = None) -> bool:
    """After a call of jitted `fn`: if it compiled (its count grew past `before`), note the shape.

    The hook around a jitted entry point, in two lines:
        n = compile_count(_core); out = _core(...); check_recompile(_core, n, "generate", ...)
    `group` keeps the first compilation of each model quiet (pass the config and dtype);
    `describe()` names the shape, e.g. "batch 1, prompt bucket 64, cache 128". Returns whether it
    warned.
    """
    after = compile_count(fn)
    if before is None or after is None or after <= before:
        return False
    return note_compile(name, describe(), group, stacklevel=4)  # warn at the jaxllm caller's caller


def note_compile(name: str, shape: str, group: Hashable = None, *, stacklevel: int = 2) -> bool:
    """Record that `name` compiled for `shape`; warn once if it had compiled for another shape."""
    with _lock:
        seen = _shapes.setdefault((name, group), [])
        if shape in seen:
            return False
        # A new sampling mode at known buckets (greedy, then sampling) compiles too, but the
        # advice below is about buckets: warn only for buckets not compiled before.
        known = {_buckets(s) for s in seen}
        seen.append(shape)
        if not known or _buckets(shape) in known:
            return False
        before = seen[-2]
    warnings.warn(
        f"jaxllm: recompiling {name} for {shape} (new shape; compiled before for {before}). "
        "Each new shape costs a compilation: keep prompt lengths, batch sizes and "
        "max_new_tokens within few buckets.", RecompileWarning, stacklevel=stacklevel)
    return True


class ShapeText(str):
    """`shape_text`'s text, which knows its buckets' part (the text without the sampling mode)."""
    buckets: str


def _buckets(shape: str) -> str:
    return getattr(shape, "buckets", shape)


def shape_text(batch: int, prompt_bucket: int, cache_length: int, steps: int | None = None,
               sampling=None) -> str:
    """'batch 1, prompt bucket 64, 64 new-token steps, cache 128, greedy': what a compile keys on."""
    parts = [f"batch {batch}", f"prompt bucket {prompt_bucket}"]
    if steps is not None:
        parts.append(f"{steps} new-token steps")
    parts.append(f"cache {cache_length}")
    buckets = ", ".join(parts)
    if sampling is not None:  # a SamplingConfig: static() is (greedy, top_k, top_p, min_p, penalty)
        greedy, *on = sampling.static()
        used = [n for n, o in zip(("top_k", "top_p", "min_p", "repetition penalty"), on) if o]
        parts.append(("greedy" if greedy else "sampling") + (" with " + ", ".join(used) if used else ""))
    text = ShapeText(", ".join(parts))
    text.buckets = buckets
    return text


def compiled_shapes(name: str, group: Hashable = None) -> list[str]:
    """The shapes `name` has compiled for in this process, in order."""
    with _lock:
        return list(_shapes.get((name, group), []))
