"""Reading HF-named tensors into Params: the read-then-place threads and the NaN scan.

The reading half of the parameter table (model/params.py declares each parameter; this module
fills them from a checkpoint's tensors), and the same for a sharded model.
"""

from __future__ import annotations

import functools
import queue
import re
import threading
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxllm import families
from jaxllm.model.config import ModelConfig
from jaxllm.model.params import ParamSpec, Params, _assemble, named_specs
from jaxllm.model.sharding import _axes_by_path, _spec, plan, to_layout


class TensorSource(Protocol):
    """HF-named tensors as `from_hf_tensors` reads them (`hf.SafetensorsReader`, `hf.ArraySource`)."""

    shapes: dict[str, tuple[int, ...]]

    def dtype(self, name: str) -> np.dtype: ...

    def position(self, name: str) -> tuple[int, int]: ...  # where its bytes lie: reads go in order

    def read_into(self, name: str, view: np.ndarray) -> None: ...  # the values, in C order


_LAYER_INDEX, _EXPERT_INDEX = re.compile(r"^model\.layers\.(\d+)\."), re.compile(r"\.experts\.(\d+)\.")


def from_hf_tensors(cfg: ModelConfig, source: TensorSource, dtype=jnp.float32,
                    place: Callable[[str, np.ndarray], Any] | None = None,
                    progress: Callable[[int], None] | None = None, threads: int = 1,
                    buffer_bytes: int = 1 << 32) -> Params:
    """Convert HF-named tensors into Params, checking the set of names and every shape first.

    `source` holds the tensors (see `TensorSource`). Each parameter is made in host memory by
    reading its sources into their parts of it (no copy), then `place(path, array)` (default:
    jnp.asarray) puts it on its device(s). A missing, unexpected or misshapen tensor is a
    ValueError naming it, raised before anything is read.

    With `threads` > 1, that many threads read parameters, the largest first and otherwise in
    the order of their bytes, and as many place them as they come: the disk keeps reading while
    the device takes what was read, with at most `buffer_bytes` read but not yet placed.
    (`place` and `progress` then run on those threads.)
    """
    # A damaged count in the config would first make a name for each of its layers and experts.
    for what, pattern, count in (("layers", _LAYER_INDEX, cfg.num_layers),
                                 ("experts", _EXPERT_INDEX, cfg.num_experts)):
        held = {m.group(1) for n in source.shapes if (m := pattern.search(n))}
        if count > len(held):
            raise ValueError(f"the config has {count} {what}, but the checkpoint holds tensors of "
                             f"{len(held)} {what} only")
    jobs = named_specs(cfg)
    family = families.of(cfg)
    hf = {path: family.hf_sources(s) for path, s in jobs}  # (HF name, shape) of each source tensor
    expected = {name: shape for path, _ in jobs for name, shape in hf[path]}
    # Checkpoints often carry the rotary inv_freq buffer; it is derived from the config instead.
    present = {n for n in source.shapes if not n.endswith("rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        present.discard("lm_head.weight")  # some tied checkpoints still store a copy
    missing = sorted(set(expected) - present)
    unexpected = sorted(present - set(expected))
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {', '.join(missing[:8])}"
                         + (" ..." if len(missing) > 8 else ""))
    if unexpected:
        raise ValueError(f"checkpoint has {len(unexpected)} unexpected tensor(s): "
                         f"{', '.join(unexpected[:8])}" + (" ..." if len(unexpected) > 8 else ""))
    for name, shape in expected.items():
        if tuple(source.shapes[name]) != shape:
            raise ValueError(f"tensor {name} has shape {tuple(source.shapes[name])}, expected "
                             f"{shape} from the config")
        stored = np.dtype(source.dtype(name))
        if not jnp.issubdtype(stored, jnp.floating):  # a cast would make values of the integers' bits
            raise ValueError(f"tensor {name} is stored as {stored.name}; its weights must be a floating "
                             "type (float32, bfloat16 or float16)")
    place = place or (lambda path, x: jnp.asarray(x, dtype))
    host_dtype = {path: np.result_type(*(source.dtype(name) for name, _ in hf[path])) for path, s in jobs}

    def read(path: str, s: ParamSpec) -> np.ndarray:
        out = np.empty(s.shape, host_dtype[path])
        parts = list(zip(hf[path], s.parts(out), strict=True))
        for (name, _), part in parts:
            source.read_into(name, part)
        if first_nonfinite(out, dtype) is not None:  # the source tensor and index named: a rare path
            for (name, shape), part in parts:
                part = np.ascontiguousarray(part)  # in the source's C order (`read_into`)
                if (at := first_nonfinite(part, dtype)) is not None:
                    at = tuple(int(i) for i in np.unravel_index(np.ravel_multi_index(at, part.shape), shape))
                    value = part.reshape(shape)[at]
                    if np.isfinite(value):
                        inf = "-inf" if value < 0 else "inf"
                        raise ValueError(f"tensor {name} holds {value} at index {at}, past what "
                                         f"{jnp.dtype(dtype).name} can hold (it would become {inf}): "
                                         "load the checkpoint in a wider dtype")
                    raise ValueError(f"tensor {name} holds {value} at index {at}: "
                                     "the checkpoint is damaged (a weight must be a finite number)")
        return out

    def put(path: str, s: ParamSpec, x: np.ndarray):
        out = place(path, x)
        if progress:
            progress(sum(int(np.prod(shape)) for _, shape in s.sources))
        return out
    if threads <= 1:
        return _assemble(cfg, lambda path, s: put(path, s, read(path, s)))
    size = {path: int(np.prod(s.shape)) * host_dtype[path].itemsize for path, s in jobs}
    # Largest first: the last parameters read are small, so little is left to place once the
    # disk is done (the 8B shape's 1 GB embed and lm_head, last, took 0.5-0.7 s each after it).
    jobs.sort(key=lambda job: (-size[job[0]], source.position(hf[job[0]][0][0])))
    placed = _read_then_place(jobs, read, put, size, threads, buffer_bytes)
    return _assemble(cfg, lambda path, s: placed[path])


# Bits of each float format's exponent: a value with all of them set is NaN or infinity. Read on
# the bits, a piece at a time so that it stays in cache: numpy's isfinite on bfloat16 ran at 2.4
# GB/s a thread, this at 5.0 (a 2-core CPU), while the disk gives the reader 2 GB/s at most.
_EXPONENT_BITS = {np.dtype(np.float16): 0x7C00, np.dtype(jnp.bfloat16): 0x7F80,
                  np.dtype(np.float32): 0x7F800000, np.dtype(np.float64): 0x7FF0000000000000}
_CHECK_PIECE = 1 << 20  # elements


@functools.cache
def _unfit_bits(source: np.dtype, target: np.dtype) -> int:
    """The bits, sign aside, of the smallest `source` magnitude that is not a finite number in
    `target` (infinity where `target` holds every finite `source` value): each larger one, NaN
    and infinity included, is not either, since magnitudes order as their bits do."""
    unsigned = np.dtype(f"u{source.itemsize}")
    fits, unfit = 0, _EXPONENT_BITS[source]  # zero fits; infinity does not
    while unfit - fits > 1:
        mid = (fits + unfit) // 2
        with np.errstate(over="ignore", invalid="ignore"):
            finite = np.isfinite(np.array(mid, unsigned).view(source).astype(target))
        if finite:
            fits = mid
        else:
            unfit = mid
    return unfit


def first_nonfinite(x: np.ndarray, dtype=None) -> tuple[int, ...] | None:
    """The index of the first NaN or infinity in a C-contiguous array, or of the first value that
    would become one cast to `dtype` (too large for it); None if there is none (and for integer
    arrays)."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return None
    target = x.dtype if dtype is None else np.dtype(jnp.dtype(dtype))
    known = x.dtype in _EXPONENT_BITS
    limit = _unfit_bits(x.dtype, target) if known else None
    magnitude = _EXPONENT_BITS[x.dtype] | (_EXPONENT_BITS[x.dtype] - 1) if known else None
    flat = x.reshape(-1)
    for start in range(0, flat.size, _CHECK_PIECE):
        piece = flat[start:start + _CHECK_PIECE]
        if known:
            bad = (piece.view(f"u{x.dtype.itemsize}") & magnitude) >= limit
        else:  # float8 and the like: no bit pattern shared by all their NaNs
            with np.errstate(over="ignore", invalid="ignore"):
                bad = ~np.isfinite(piece.astype(target))
        if bad.any():
            return tuple(int(i) for i in np.unravel_index(start + int(np.argmax(bad)), x.shape))
    return None


def _read_then_place(jobs: list[tuple[str, ParamSpec]], read, put, size: dict[str, int],
                     threads: int, buffer_bytes: int) -> dict[str, Any]:
    """`threads` threads read the jobs in order, `threads` more place what was read, as it comes;
    a reader waits while `buffer_bytes` are read and not yet placed (unless nothing is, so one
    larger job still goes). The first failure stops both and is raised."""
    todo, ready = iter(jobs), queue.Queue()
    held, failures, placed = 0, [], {}
    moved = threading.Condition()

    def reader():
        nonlocal held
        while True:
            with moved:
                job = next(todo, None)
                while job and held and held + size[job[0]] > buffer_bytes and not failures:
                    moved.wait()
                if job is None or failures:
                    return
                held += size[job[0]]
            try:
                ready.put((job, read(*job)))
            except BaseException as e:  # noqa: BLE001 - raised by the caller below
                with moved:
                    failures.append(e)
                    held -= size[job[0]]
                    moved.notify_all()
                return

    def placer():
        nonlocal held
        while (item := ready.get()) is not None:
            (path, s), x = item
            failure = None
            try:
                if not failures:  # placed in full before its host memory counts as free
                    placed[path] = jax.block_until_ready(put(path, s, x))
            except BaseException as e:  # noqa: BLE001
                failure = e
            del item, x
            with moved:
                if failure is not None:
                    failures.append(failure)
                held -= size[path]
                moved.notify_all()
    readers = [threading.Thread(target=reader, name=f"jaxllm-read-{i}") for i in range(threads)]
    placers = [threading.Thread(target=placer, name=f"jaxllm-place-{i}") for i in range(threads)]
    for t in readers + placers:
        t.start()
    try:
        for t in readers:
            t.join()
    except BaseException as e:  # Ctrl-C: the threads stop after the reads and places under way
        with moved:
            failures.append(e)
            moved.notify_all()
        raise
    finally:
        for _ in placers:
            ready.put(None)
    for t in placers:
        t.join()
    if failures:
        raise failures[0]
    return placed


def from_hf_sharded(cfg: ModelConfig, source: TensorSource, dtype, mesh: Mesh, *,
                    expert_parallel: bool = False, progress=None, threads: int = 1,
                    buffer_bytes: int = 1 << 32) -> Params:
    """Convert HF-named tensors straight into shards: each parameter is made on the host (as
    `from_hf_tensors` makes it, `threads` at a time), and each device receives only its slice,
    cast to `dtype` per slice."""
    layout, tp = plan(cfg, mesh, expert_parallel)
    axes = _axes_by_path(layout)
    np_dtype = jnp.dtype(dtype)

    def place(path: str, x: np.ndarray) -> jax.Array:
        x = to_layout(path.rsplit(".", 1)[-1], x, cfg, tp.kv_replicas)
        sharding = NamedSharding(mesh, _spec(tp, axes[path]))
        return jax.make_array_from_callback(x.shape, sharding,
                                            lambda index: np.ascontiguousarray(x[index], np_dtype))
    params = from_hf_tensors(cfg, source, dtype=dtype, place=place, progress=progress,
                             threads=threads, buffer_bytes=buffer_bytes)
    return params.replace(config=layout, tp=tp)
