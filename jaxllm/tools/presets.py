"""Model shapes of real checkpoints, usable with random weights (benchmarks, roofline, eval_shape).

Each preset is the `ModelConfig` that `families.config_from_hf` builds from the checkpoint's
config.json, written out so no download is needed. `random_params` fills such a config with random
weights directly on the device, one bounded piece at a time, so an 8B model is never staged
through the host and the device never holds more than the weights plus one piece in float32.
"""

from __future__ import annotations

import json
import math
import os
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import families
from jaxllm.io import checkpoint
from jaxllm.io.paths import make_empty_dir
from jaxllm.layers.quant import QUANT_MODES, QuantizedWeight, quantize
from jaxllm.model.config import ModelConfig, RopeConfig
from jaxllm.model.params import Params, abstract_params, leaf_paths, named_specs, quantize_leaf

# Llama 3.1 / 3.2 RoPE: the "llama3" frequency scaling of an 8192-token original context.
_LLAMA31_ROPE = RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                           high_freq_factor=4.0, original_max_position_embeddings=8192)
_LLAMA32_ROPE = RopeConfig(theta=500000.0, rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                           high_freq_factor=4.0, original_max_position_embeddings=8192)

PRESETS: dict[str, ModelConfig] = {
    # Test-sized: every dimension distinct enough that a swapped axis shows up as a shape error.
    "tiny": ModelConfig(
        model_type="llama", vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, ffn_size=128, max_position_embeddings=1024, rms_norm_eps=1e-5,
        rope=RopeConfig(theta=10000.0), bos_token_id=1, eos_token_ids=(2,)),
    # Test-sized mixture of experts (4 experts, top-2), for the bench's MoE and expert-parallel paths.
    # ffn_size is the experts' F, as `families.config_from_hf` reads a Mixtral config.json.
    "tiny-moe": ModelConfig(
        model_type="mixtral", vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, ffn_size=96, max_position_embeddings=1024, rms_norm_eps=1e-5,
        rope=RopeConfig(theta=10000.0), num_experts=4, experts_per_token=2, moe_ffn_size=96,
        norm_topk_prob=True, moe_layers=(True, True), bos_token_id=1, eos_token_ids=(2,)),
    # HuggingFaceTB/SmolLM2-135M-Instruct (the default model's shape).
    "smollm2-135m": ModelConfig(
        model_type="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, ffn_size=1536, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope=RopeConfig(theta=100000.0), tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
        pad_token_id=2),
    # Qwen/Qwen3-0.6B: explicit head_dim 128 (N*H = 2048 > D = 1024), per-head q/k norms.
    "qwen3-0.6b": ModelConfig(
        model_type="qwen3", vocab_size=151936, hidden_size=1024, num_layers=28, num_heads=16,
        num_kv_heads=8, head_dim=128, ffn_size=3072, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope=RopeConfig(theta=1000000.0), tie_word_embeddings=True, qk_norm=True,
        bos_token_id=151643, eos_token_ids=(151645,)),
    # meta-llama/Llama-3.2-1B.
    "llama3.2-1b": ModelConfig(
        model_type="llama", vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32,
        num_kv_heads=8, head_dim=64, ffn_size=8192, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope=_LLAMA32_ROPE, tie_word_embeddings=True, bos_token_id=128000, eos_token_ids=(128001,)),
    # meta-llama/Llama-3.1-8B (Llama-3-8B's shapes with the 3.1 rope scaling and 128k context).
    "llama3-8b": ModelConfig(
        model_type="llama", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, ffn_size=14336, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope=_LLAMA31_ROPE, bos_token_id=128000, eos_token_ids=(128001,)),
    # mistralai/Mistral-7B-v0.3: v0.1's 4096-token sliding window is gone, the vocabulary is 32768.
    "mistral-7b": ModelConfig(
        model_type="mistral", vocab_size=32768, hidden_size=4096, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, ffn_size=14336, max_position_embeddings=32768, rms_norm_eps=1e-5,
        rope=RopeConfig(theta=1000000.0), bos_token_id=1, eos_token_ids=(2,)),
    # meta-llama/Llama-3.1-70B (for tensor parallelism: 141 GB of bf16 weights).
    "llama3-70b": ModelConfig(
        model_type="llama", vocab_size=128256, hidden_size=8192, num_layers=80, num_heads=64,
        num_kv_heads=8, head_dim=128, ffn_size=28672, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope=_LLAMA31_ROPE, bos_token_id=128000, eos_token_ids=(128001,)),
    # mistralai/Mixtral-8x7B-v0.1: 8 experts, 2 per token, no sliding window.
    "mixtral-8x7b": ModelConfig(
        model_type="mixtral", vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, ffn_size=14336, max_position_embeddings=32768, rms_norm_eps=1e-5,
        rope=RopeConfig(theta=1000000.0), num_experts=8, experts_per_token=2, moe_ffn_size=14336,
        norm_topk_prob=True, moe_layers=(True,) * 32, bos_token_id=1, eos_token_ids=(2,)),
    # Qwen/Qwen3-30B-A3B: 128 experts of F 768, 8 per token, on every layer.
    "qwen3-30b-a3b": ModelConfig(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32,
        num_kv_heads=4, head_dim=128, ffn_size=6144, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope=RopeConfig(theta=1000000.0), qk_norm=True, num_experts=128, experts_per_token=8,
        moe_ffn_size=768, norm_topk_prob=True, moe_layers=(True,) * 48,
        bos_token_id=151643, eos_token_ids=(151645,)),
    # google/gemma-3-1b-it: a 512-token window on 5 of every 6 layers, which rotate with base 1e4
    # (the global ones 1e6, no scaling); one KV head of 256; (1 + w) norms, post-norms, GeGLU.
    "gemma3-1b": ModelConfig(
        model_type="gemma3_text", vocab_size=262144, hidden_size=1152, num_layers=26, num_heads=4,
        num_kv_heads=1, head_dim=256, ffn_size=6912, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope=RopeConfig(theta=1000000.0), local_rope=RopeConfig(theta=10000.0), tie_word_embeddings=True,
        qk_norm=True, sliding_window=512, sliding_layers=tuple((i + 1) % 6 != 0 for i in range(26)),
        norm_offset=1.0, activation="gelu_tanh", post_norms=True, embed_scale=True,
        query_pre_attn_scalar=256, bos_token_id=2, eos_token_ids=(1, 106), pad_token_id=0),
    # google/gemma-2-2b-it: a 4096-token window on every other layer, scores capped at 50 and
    # logits at 30; (1 + w) norms, post-norms, GeGLU.
    "gemma2-2b": ModelConfig(
        model_type="gemma2", vocab_size=256000, hidden_size=2304, num_layers=26, num_heads=8,
        num_kv_heads=4, head_dim=256, ffn_size=9216, max_position_embeddings=8192, rms_norm_eps=1e-6,
        rope=RopeConfig(theta=10000.0), tie_word_embeddings=True, sliding_window=4096,
        sliding_layers=tuple(i % 2 == 0 for i in range(26)), norm_offset=1.0, activation="gelu_tanh",
        post_norms=True, embed_scale=True, query_pre_attn_scalar=256, attn_logit_softcap=50.0,
        final_logit_softcap=30.0, bos_token_id=2, eos_token_ids=(1, 107), pad_token_id=0),
}


def get_config(name_or_path: str | os.PathLike) -> ModelConfig:
    """A preset by name, else the config of what `jaxllm.load` reads there: a Hugging Face
    checkpoint directory (its config.json), a `jaxllm convert` directory (its jaxllm_config.json)
    or a .gguf file (its header)."""
    if isinstance(name_or_path, str) and name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if not str(name_or_path).strip():  # Path("") is the current directory: never what was meant
        raise ValueError(f"empty model name: give a preset ({', '.join(PRESETS)}) or a checkpoint path")
    path = Path(name_or_path)
    if path.is_dir() and checkpoint.is_checkpoint(path):
        return checkpoint.read_config(path)
    if path.is_file() and path.suffix == ".gguf":
        from jaxllm.io.gguf import gguf_to_hf_config  # lazy: the gguf package is slow to import
        return families.config_from_hf(gguf_to_hf_config(path))
    if path.is_dir() or path.name == "config.json":
        return families.config_from_hf(path)
    raise ValueError(f"{str(name_or_path)!r} is neither a preset ({', '.join(PRESETS)}) nor a checkpoint "
                     f"(a Hugging Face directory with config.json, a `jaxllm convert` directory or a "
                     f".gguf file)")


# Elements drawn per piece: 2**26 float32 values are 256 MiB of scratch on top of the weights.
PIECE_ELEMENTS = 1 << 26


@partial(jax.jit, static_argnames=("shape", "dtype"))
def _normal(key, scale, *, shape, dtype):
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def _piece(shape, rows, key, scale, dtype):
    """The normal(0, scale) values of `rows` rows (at most) of a tensor of `shape`, float or
    quantized alike (so both hold the same values)."""
    return _normal(key, scale, shape=(min(shape[0], rows),) + shape[1:], dtype=dtype)


def _fill_rows(buf, key, row, scale, *, rows):
    """Write `rows` normal(0, scale) rows into buf at `row` (axis 0); rows beyond the end are clamped."""
    return jax.lax.dynamic_update_slice_in_dim(buf, _piece(buf.shape, rows, key, scale, buf.dtype), row, 0)


def _rows_per_piece(shape) -> int:
    return max(1, PIECE_ELEMENTS // max(1, math.prod(shape[1:])))


def _fill_quantized_rows(q, s, key, row, scale, *, rows, dtype):
    """`_fill_rows` for a quantized matrix: the piece drawn in `dtype`, then its int8 values and
    scales (one per output channel: s's axes) written at `row`. Each output row has its own scale,
    so the pieces quantize as the whole matrix would."""
    part = quantize(_piece(q.shape, rows, key, scale, dtype), q.ndim - s.ndim, dtype)
    return (jax.lax.dynamic_update_slice_in_dim(q, part.q, row, 0),
            jax.lax.dynamic_update_slice_in_dim(s, part.scale, row, 0))


_fill_jit = {}


def _filler(quantized: bool = False):
    # Donating the buffers makes each piece an in-place write; the CPU cannot donate (and warns).
    # The rows of a piece are static: a traced filler keeps the piece size it was traced with.
    backend = jax.default_backend()
    if (backend, quantized) not in _fill_jit:
        fn, buffers = (_fill_quantized_rows, (0, 1)) if quantized else (_fill_rows, (0,))
        _fill_jit[backend, quantized] = jax.jit(
            fn, donate_argnums=() if backend == "cpu" else buffers,
            static_argnames=("rows", "dtype") if quantized else ("rows",))
    return _fill_jit[backend, quantized]


def random_params(cfg: ModelConfig, seed: int = 0, dtype=jnp.bfloat16, scale: float = 0.02,
                  quant: str = "none") -> Params:
    """Random weights of the config's shapes, made on the default device in bounded pieces.

    Vectors (norm weights, output biases) are ones; every other tensor is normal(0, scale), so no
    timing runs on zeros. Unlike `init_params` (which draws each tensor whole in float32), the
    transient memory is at most one piece, so peak-memory readings after it reflect the model.
    With quant="int8" each matrix that `params.quantize_params` quantizes is quantized piece by
    piece as it is drawn: the same params as quantize_params of the float ones, but the device
    holds one float piece at a time, never a float matrix beside the int8 model.

    Every buffer is allocated before the first piece is drawn, so no weight is placed in a piece's
    freed scratch: XLA's GPU allocator (best-fit with coalescing) hands out a free block under
    twice the size asked for, and under 128 MB over it, whole, and counts all of it in use. The 8B
    shape's int8 weights, each matrix allocated as it was drawn, held 1.19 GB beyond their 8.56.
    """
    if quant not in QUANT_MODES:
        raise ValueError(f"unknown quantization {quant!r}; choose one of {', '.join(QUANT_MODES)}")
    dtype = jnp.dtype(dtype)
    key = jax.random.key(seed)
    abstract = abstract_params(cfg, dtype)
    leaves, treedef = jax.tree.flatten(abstract)
    tied = cfg.tie_word_embeddings
    targets = [jax.eval_shape(partial(quantize_leaf, path, tied=tied, dtype=dtype), leaf)
               if quant == "int8" else leaf for path, leaf in zip(leaf_paths(abstract), leaves)]
    out = [_buffer(t) for t in targets]
    for i in range(len(out)):  # each buffer replaced by its filled self, nothing else keeping it
        out[i] = _fill(out[i], jax.random.fold_in(key, i), scale)
    return jax.tree.unflatten(treedef, out)


def _buffer(target):
    """A vector's ones (its value), else zeros of target's shapes for `_fill` to overwrite."""
    if not isinstance(target, QuantizedWeight) and target.ndim == 1:
        return jnp.ones(target.shape, target.dtype)
    return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), target)


def _fill(buf, key, scale):
    """buf (a matrix, or a QuantizedWeight's values and scales) filled with normal(0, scale) rows,
    piece by piece in place; a vector stays as it is (ones)."""
    if buf.ndim == 1:
        return buf
    quantized = isinstance(buf, QuantizedWeight)
    shape = buf.shape
    rows = _rows_per_piece(shape)
    for piece, row in enumerate(range(0, shape[0], rows)):
        # The last piece starts early enough to fit (dynamic_update_slice clamps): it overlaps.
        # A matrix of one piece draws from the leaf's own key.
        piece_key = key if rows >= shape[0] else jax.random.fold_in(key, piece)
        if quantized:
            q, s = _filler(quantized=True)(buf.q, buf.scale, piece_key, jnp.int32(row), scale,
                                           rows=rows, dtype=buf.dtype)
            buf = buf.replace(q=q, scale=s)
        else:
            buf = _filler()(buf, piece_key, jnp.int32(row), scale, rows=rows)
    return buf


# The largest safetensors file `write_checkpoint` writes, as transformers' save_pretrained shards.
SHARD_BYTES = 5 * 10**9


def write_checkpoint(cfg: ModelConfig, path: str | os.PathLike, seed: int = 0,
                     dtype=jnp.bfloat16, scale: float = 0.02,
                     shard_bytes: int = SHARD_BYTES) -> list[Path]:
    """Write a Hugging Face checkpoint directory of the config's shapes with random weights:
    config.json (`families.config_to_hf`) and safetensors files of at most `shard_bytes` each, with
    their index where there are several, as save_pretrained lays them out. Norm weights are ones,
    biases zeros, every other tensor normal(0, scale) values: a block of 2^22 drawn once, each
    tensor a copy of it from a random offset, repeated, rather than every value drawn (an 8B
    model's take a while). Returns the safetensors files written.

    `path` must not exist or be an empty directory: writing into another checkpoint would replace
    some of its files and leave the rest (a tokenizer, other shards), two models mixed."""
    from safetensors.numpy import save_file

    path = Path(path)
    make_empty_dir(path)
    dtype = jnp.dtype(dtype)
    rng = np.random.default_rng(seed)
    block = (scale * rng.standard_normal((1 << 22) + (1 << 20), np.float32)).astype(dtype)
    shards, shard, size = [], {}, 0
    family = families.of(cfg)
    for _, spec in named_specs(cfg):
        for name, shape in family.hf_sources(spec):
            if spec.init == "normal":
                start = int(rng.integers(1 << 20))
                tensor = np.resize(block[start:], shape)
            else:
                tensor = np.full(shape, 1 if spec.init == "ones" else 0, dtype)
            if shard and size + tensor.nbytes > shard_bytes:
                shards.append(shard)
                shard, size = {}, 0
            shard[name] = tensor
            size += tensor.nbytes
    shards.append(shard)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for name, tensors in zip(names, shards):
        save_file(tensors, str(path / name), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.nbytes for s in shards for t in s.values())},
                 "weight_map": {k: name for name, s in zip(names, shards) for k in s}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config = dict(families.config_to_hf(cfg), torch_dtype=dtype.name)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return [path / n for n in names]
