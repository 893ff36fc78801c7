"""`jaxllm.load`: one entry point for HF directories, GGUF files and the embedded default model.

GGUF weights are dequantized tensor by tensor, a block of rows at a time, straight into the dtype
asked for, and written as they go to a safetensors cache in that dtype (under `paths.cache_dir()`,
keyed by the file's name, size, mtime and the dtype), so the second start reads instead of
dequantizing: on numpy, dequantizing runs at a fraction of a disk's read speed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxllm import families
from jaxllm.env import env_number
from jaxllm.io import checkpoint, hf, paths, reading
from jaxllm.io.reading import from_hf_tensors
from jaxllm.layers.quant import QUANT_MODES
from jaxllm.model.config import ModelConfig
from jaxllm.model.params import Params, is_quantized, quantize_params, quantizing_place

CACHE_FORMAT = 2  # bump when the cached conversion changes


def default_dtype():
    """bfloat16 on accelerators; float32 on the CPU, where XLA's bf16 math is slow and inexact."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def _progress(total: int, desc: str):
    """A tqdm bar on a terminal; a silent counter otherwise."""
    if sys.stderr.isatty():
        from tqdm import tqdm
        bar = tqdm(total=total, desc=desc, unit="param", unit_scale=True, leave=False)
        return bar.update, bar.close
    return None, lambda: None


RUN_DTYPES = tuple(np.dtype(jnp.dtype(d)) for d in ("float32", "bfloat16", "float16"))


def _float_dtype(dtype) -> np.dtype:
    """`dtype` as a floating dtype (the weights', activations' and cache's), or a ValueError."""
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"unknown dtype {dtype!r}: use float32, bfloat16 or float16") from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype must be a floating type (float32, bfloat16 or float16), got {dtype}")
    if dtype not in RUN_DTYPES:  # float64 became float32 without x64; float8 ran, with other tokens
        raise ValueError(f"dtype {dtype} is not one jaxllm runs a model in: use float32, bfloat16 or "
                         "float16 (for 8-bit weights, quant='int8')")
    return dtype


def load(path: str | os.PathLike | None = None, *, dtype=None, mesh=None,
         expert_parallel: bool = False, quant: str = "none") -> Params:
    """Load a model: None (the default SmolLM2), an HF directory, a .gguf file, or a directory
    written by `jaxllm convert` (an orbax checkpoint of converted params, see checkpoint.py).

    `quant="int8"` stores the projection matrices as int8 with per-output-channel scales (see
    `jaxllm.quant`), each quantized on the device as it is loaded, so the float model is never
    resident whole; `dtype` stays the dtype of activations, KV cache and the other weights.

    With a `mesh` (see `sharding.make_mesh`) each device receives only its shard, converted from
    the checkpoint one tensor at a time; `expert_parallel` splits MoE experts instead of their F.
    """
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike (or None for the default model), got "
                        f"{type(path).__name__} {path!r:.80}")
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (see jaxllm.model.sharding.make_mesh), got "
                        f"{type(mesh).__name__} {mesh!r:.80}")
    if mesh is not None and any(t != AxisType.Auto for t in mesh.axis_types):
        # jax.make_mesh makes Explicit axes by default; the model's shard_map and the shardings
        # XLA propagates around it take Auto ones: the same devices and names, as Auto axes.
        mesh = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
    shard = None if mesh is None else dict(mesh=mesh, expert_parallel=expert_parallel)
    if quant not in QUANT_MODES:
        raise ValueError(f"unknown quantization {quant!r}; choose one of {', '.join(QUANT_MODES)}")
    if quant != "none" and mesh is not None:
        raise ValueError("int8 quantization of a sharded (mesh=) load is not implemented yet")
    # The device backend starts before the checkpoint is read, not beside the readers: on a fresh
    # machine it reads its libraries (0.7-1.2 GB: the CUDA plugin, cuBLAS, NVRTC...) from the disk
    # the checkpoint is on, and its page faults waited behind the readers' queue
    # (docs/decisions/loading.md#the-backend-first).
    jax.devices()
    dtype = _float_dtype(dtype) if dtype is not None else default_dtype()
    if path is None:
        path = paths.default_model_path()
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no model at {path}")
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path, dtype, shard, quant)
    if path.is_file():
        raise ValueError(f"{path} is neither a .gguf file nor a Hugging Face checkpoint directory")
    if checkpoint.is_checkpoint(path):  # written by `jaxllm convert`: restored slice by slice
        params = checkpoint.restore(path, dtype=dtype, mesh=mesh, expert_parallel=expert_parallel)
        if is_quantized(params):  # converted with --quant int8 already
            return params
        return quantize_params(params, quant)  # whole, after the restore: float and int8 at once
    return _load_hf(path, dtype, path.name, shard, quant)


# Threads reading parameters, and as many placing them (`reading.from_hf_tensors`), with at most
# LOAD_BUFFER_BYTES of host memory read but not yet placed (at most half the memory available):
# room for the disk to go on reading while the device takes what was read
# (docs/decisions/loading.md#buffered-reads-not-direct-io).
LOAD_THREADS = env_number("JAXLLM_LOAD_THREADS", "8")
LOAD_BUFFER_BYTES = int(env_number("JAXLLM_LOAD_BUFFER_MB", "8192", float) * 2**20)


def _buffer_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):  # not Linux: the setting as it is
        return LOAD_BUFFER_BYTES
    return min(LOAD_BUFFER_BYTES, kib * 1024 // 2)


def _load_hf(path: Path, dtype, name: str, shard: dict | None, quant: str) -> Params:
    """An HF checkpoint directory, read and converted through `_convert`."""
    cfg, reader = hf.read_checkpoint(path)
    with reader:
        return _convert(cfg, reader, dtype, name, shard, quant)


def _convert(cfg: ModelConfig, source, dtype, name: str, shard: dict | None = None,
             quant: str = "none", threads: int = LOAD_THREADS) -> Params:
    total = sum(int(np.prod(s)) for s in source.shapes.values())
    update, close = _progress(total, f"loading {name}")
    flow = dict(progress=update, threads=threads, buffer_bytes=_buffer_bytes())
    try:
        if shard is not None:
            return reading.from_hf_sharded(cfg, source, dtype, **shard, **flow)
        place = None if quant == "none" else quantizing_place(dtype, cfg.tie_word_embeddings)
        return from_hf_tensors(cfg, source, dtype=dtype, place=place, **flow)
    finally:
        close()


def _gguf_cache_path(path: Path, dtype) -> Path:
    """Keyed by the file (path, size, mtime), the dtype and the code that converts it: an edited
    io/gguf.py or model/config.py (stop ids) must never be served a conversion the old code wrote."""
    st = path.stat()
    dtype = np.dtype(jnp.dtype(dtype)).name
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{CACHE_FORMAT}:{dtype}".encode())
    package = Path(__file__).parent.parent
    for source in ("io/gguf.py", "model/config.py"):
        key.update((package / source).read_bytes())
    return paths.cache_dir() / f"{path.stem}-{dtype}-{key.hexdigest()[:16]}"


def _load_gguf(path: Path, dtype, shard: dict | None = None, quant: str = "none") -> Params:
    from jaxllm.io.gguf import gguf_source, gguf_stop_ids  # lazy: the gguf package is slow to import

    cached = _gguf_cache_path(path, dtype)
    # A killed (SIGKILL) start's partial entry, `<entry>.tmp<PID>`, is removed by the next start.
    paths.remove_stale(cached.parent, r".+\.tmp(\d+)")
    if (cached / "config.json").is_file() and (cached / "model.safetensors").is_file():
        try:
            return _load_hf(cached, dtype, path.name, shard, quant)
        except ValueError as e:  # damaged on disk since: never served again
            import shutil
            shutil.rmtree(cached, ignore_errors=True)
            raise ValueError(f"{cached}, the converted copy of {path}, is damaged ({e}); it was removed, "
                             f"so the next start converts {path.name} again") from None
    hf_config, source = gguf_source(path, dtype)
    cfg = families.config_from_hf(hf_config)
    # Stop ids: the GGUF's eos plus the chat template's end-of-turn token, as the tokenizer knows them.
    stops = gguf_stop_ids(path)
    cfg = dataclasses.replace(cfg, eos_token_ids=tuple(dict.fromkeys(cfg.eos_token_ids + stops)))
    cache = _CacheWriter(cached)
    try:  # from the temporary's making on: an interruption anywhere removes it
        cache.start(source)
        source.sink = cache.write
        # Dequantizing is arithmetic, not waiting on a disk: readers beyond the cores only hold
        # more blocks and parameters in memory at once.
        threads = max(1, min(LOAD_THREADS, os.cpu_count() or 1))
        params = _convert(cfg, source, dtype, path.name, shard, quant, threads)
        cache.commit(hf_config, cfg)
    finally:
        cache.discard()
    return params


_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


class _CacheWriter:
    """A safetensors file of the converted tensors, written block by block as they are
    dequantized (no copy of the model is held for it), into `<entry>.tmp<PID>` and moved into place
    only once the whole load succeeded. Best effort: a read-only or full disk only costs the next
    start its dequantization."""

    def __init__(self, target: Path):
        self.target, self.fd, self.lock, self.ok = target, None, threading.Lock(), True
        self.writing, self.closing = 0, False  # writes under way; whether the last one closes fd
        self.tmp = target.with_name(target.name + f".tmp{os.getpid()}")

    def start(self, source) -> None:
        """Make the temporary entry: the safetensors header of `source`'s tensors, the file sized."""
        dtype = np.dtype(source.dtype(next(iter(source.shapes), "")))
        self.itemsize, header, end = dtype.itemsize, {}, 0
        for name in sorted(source.shapes, key=source.position):
            size = int(np.prod(source.shapes[name])) * dtype.itemsize
            header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype.name],
                            "shape": list(source.shapes[name]), "data_offsets": [end, end + size]}
            end += size
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        self.starts = {name: 8 + len(text) + t["data_offsets"][0] for name, t in header.items()}
        self.left = end  # bytes not yet written: the cache is kept only when every one was
        try:
            self.tmp.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.tmp / "model.safetensors", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.write(self.fd, struct.pack("<Q", len(text)) + text)
            os.ftruncate(self.fd, 8 + len(text) + end)
        except OSError as e:
            self._fail(e)

    def _fail(self, e: OSError) -> None:
        if self.ok and not self.closing:
            print(f"jaxllm: could not cache converted weights in {self.target}: {e}", file=sys.stderr)
        self.ok = False

    def write(self, name: str, start: int, values: np.ndarray) -> None:
        with self.lock:
            if not self.ok or self.closing:
                return
            self.writing += 1  # the descriptor stays open until this write is done
        data = memoryview(np.ascontiguousarray(values).reshape(-1).view(np.uint8))
        try:
            if os.pwrite(self.fd, data, self.starts[name] + start * self.itemsize) != len(data):
                raise OSError("short write (is the disk full?)")
        except OSError as e:
            with self.lock:
                self._fail(e)
        else:
            with self.lock:
                self.left -= len(data)
        finally:
            with self.lock:
                self.writing -= 1
                if self.closing and not self.writing:
                    self._close()

    def _close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def commit(self, hf_config: dict, cfg: ModelConfig) -> None:
        """Called once every tensor was read and checked: the cache is complete, moved into place."""
        if not self.ok or self.left:
            return
        try:
            self._close()
            (self.tmp / "config.json").write_text(json.dumps(hf_config, indent=1))
            (self.tmp / "generation_config.json").write_text(
                json.dumps({"eos_token_id": list(cfg.eos_token_ids)}))
            os.replace(self.tmp, self.target)
        except OSError as e:
            if (self.target / "config.json").is_file() and (self.target / "model.safetensors").is_file():
                return  # another process, starting at the same time, made the same entry first
            self._fail(e)

    def discard(self) -> None:
        """Remove what was not moved into place (after a failure, Ctrl-C or SIGTERM in the CLI): the
        reads under way may still write, so the last of them closes the descriptor."""
        with self.lock:
            self.closing = True
            if not self.writing:
                self._close()
        if self.tmp.exists():
            import shutil
            shutil.rmtree(self.tmp, ignore_errors=True)
