"""`jaxllm.load`: one entry point for HF directories, GGUF files and the embedded default model.

GGUF weights are dequantized once and the result is cached on disk as safetensors (under
`paths.cache_dir()`, keyed by the file's name, size and mtime), so the second start skips it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import checkpoint, hf, paths, sharding
from jaxllm.config import ModelConfig
from jaxllm.params import Params, from_hf_tensors, specs_in_order
from jaxllm.quant import QUANT_MODES, is_quantized, quantize_params, quantizing_place

CACHE_FORMAT = 1  # bump when the cached conversion changes


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
    shard = None if mesh is None else dict(mesh=mesh, expert_parallel=expert_parallel)
    if quant not in QUANT_MODES:
        raise ValueError(f"unknown quantization {quant!r}; choose one of {', '.join(QUANT_MODES)}")
    if quant != "none" and mesh is not None:
        raise ValueError("int8 quantization of a sharded (mesh=) load is not implemented yet")
    dtype = jnp.dtype(dtype) if dtype is not None else default_dtype()
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


# Parameters read, converted and placed at once (`params.from_hf_tensors`' threads). The 8B shape
# from a cold page cache on an H200 machine (bench --cold, two rounds): 8 threads 9.3 and 13.6 s,
# 4 threads 9.6 and 11.0; a Python thread reading ahead of them in file order (2-4 GB) no
# better (8.7-13.2), and 1.0-1.7 s slower with the files cached.
LOAD_THREADS = int(os.environ.get("JAXLLM_LOAD_THREADS", "8"))
# How far ahead of the threads the kernel is asked to read (`hf.SafetensorsReader.read_ahead`):
# page cache, which the kernel takes back under pressure. The 8B shape, cold, same machine and
# run (bench --cold; the load's rate over a plain read's): 16 GB 8.14 s (83%, one round), 4 GB
# 9.20-9.52 (72-74%), none 9.47-10.70 (67-72%); 4.2 s cached either way. 0 turns it off.
READ_AHEAD_BYTES = int(float(os.environ.get("JAXLLM_READ_AHEAD_MB", "16384")) * 2**20)


def hf_order(cfg: ModelConfig) -> list[str]:
    """The checkpoint's tensor names in the order `from_hf_tensors` asks for them."""
    return [name for s in specs_in_order(cfg) for name, _ in s.hf]


def _load_hf(path: Path, dtype, name: str, shard: dict | None, quant: str) -> Params:
    """An HF checkpoint directory through `_convert`, the kernel reading its files ahead."""
    cfg, reader = hf.read_checkpoint(path)
    with reader:
        reader.read_ahead(hf_order(cfg), READ_AHEAD_BYTES)
        return _convert(cfg, reader.get, reader.shapes, dtype, name, shard, quant)


def _convert(cfg: ModelConfig, get, shapes, dtype, name: str, shard: dict | None = None,
             quant: str = "none") -> Params:
    total = sum(int(np.prod(s)) for s in shapes.values())
    update, close = _progress(total, f"loading {name}")
    try:
        if shard is not None:
            return sharding.from_hf_sharded(cfg, get, shapes, dtype, progress=update,
                                            threads=LOAD_THREADS, **shard)
        place = None if quant == "none" else quantizing_place(dtype, cfg.tie_word_embeddings)
        return from_hf_tensors(cfg, get, shapes, dtype=dtype, place=place, progress=update,
                               threads=LOAD_THREADS)
    finally:
        close()


def _gguf_cache_path(path: Path) -> Path:
    """Keyed by the file (path, size, mtime) and by the code that converts it: an edited gguf.py or
    tokenizer.py (stop ids) must never be served a conversion the old code wrote."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{CACHE_FORMAT}".encode())
    here = Path(__file__).parent
    for source in ("gguf.py", "tokenizer.py"):
        key.update((here / source).read_bytes())
    return paths.cache_dir() / f"{path.stem}-{key.hexdigest()[:16]}"


def _load_gguf(path: Path, dtype, shard: dict | None = None, quant: str = "none") -> Params:
    from jaxllm.gguf import read_gguf
    from jaxllm.tokenizer import load_tokenizer

    cached = _gguf_cache_path(path)
    if (cached / "config.json").is_file() and (cached / "model.safetensors").is_file():
        return _load_hf(cached, dtype, path.name, shard, quant)
    hf_config, tensors = read_gguf(path)
    cfg = ModelConfig.from_hf(hf_config)
    # Stop ids: the GGUF's eos plus the chat template's end-of-turn token, as the tokenizer knows them.
    stops = tuple(load_tokenizer(path).eos_token_ids)
    cfg = dataclasses.replace(cfg, eos_token_ids=tuple(dict.fromkeys(cfg.eos_token_ids + stops)))
    _write_cache(cached, hf_config, cfg, tensors)
    get, shapes = hf.hf_state_dict_reader(tensors)
    return _convert(cfg, get, shapes, dtype, path.name, shard, quant)


def _write_cache(target: Path, hf_config: dict, cfg: ModelConfig, tensors: dict[str, np.ndarray]):
    """Best effort: a read-only or full disk only costs the next start its dequantization."""
    from safetensors.numpy import save_file

    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=1))
        (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": list(cfg.eos_token_ids)}))
        os.replace(tmp, target)
    except OSError as e:
        print(f"jaxllm: could not cache converted weights in {target}: {e}", file=sys.stderr)
    finally:
        if tmp.exists():
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
