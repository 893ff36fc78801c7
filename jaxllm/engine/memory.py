"""Will a generation fit in device memory? Checked on the host before anything is allocated.

The weights are on the device already (inside the allocator's `bytes_in_use`); a request adds
its KV cache (`cache_bytes`, exact) and what one step holds besides weights and cache (a bound,
`activation_bytes`). Those must fit in what the allocator has left, `bytes_limit - bytes_in_use`
of `Device.memory_stats()`; where they do, `generate` and `stream` also check XLA's own count of
what their compiled programs allocate. The CPU keeps no statistics: there the host's own figures
stand in (`host_memory_stats`). A request that cannot fit is a ValueError giving both figures and
the largest batch, and the longest cache, that would; without it, XLA would fail later with an
out-of-memory error naming a buffer, or the host would swap.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxllm.layers.dense import uses_cudnn_attention
from jaxllm.layers.moe import moe_path
from jaxllm.model.cache import cache_bytes
from jaxllm.model.config import ModelConfig
from jaxllm.model.params import Params, param_bytes

F32 = 4
# XLA's buffer assignment keeps more than one layer's intermediates live: the check multiplies the
# one-layer count of `activation_bytes` by this (docs/decisions/loop-and-compiler.md#the-memory-bound-and-xlas-count).
LIVE_FACTOR = 2.5


def memory_stats(device) -> dict | None:
    """The allocator's statistics of `device`; for a CPU device, which keeps none, the host's
    (`host_memory_stats`); None where neither is known (tests patch this)."""
    stats = device.memory_stats()
    if stats or device.platform != "cpu":
        return stats
    return host_memory_stats()


def host_memory_stats(meminfo: str = "/proc/meminfo") -> dict | None:
    """The host's memory as the allocator's statistics: `bytes_limit` its total, `bytes_in_use`
    what is not available (Linux's MemTotal and MemAvailable); None where the file is not there or
    lacks them. The CPU backend's arrays, the weights among them, are in use there already."""
    try:
        with open(meminfo) as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        total, available = (int(fields[k].split()[0]) * 1024 for k in ("MemTotal", "MemAvailable"))
    except (OSError, KeyError, ValueError, IndexError):
        return None
    return {"bytes_limit": total, "bytes_in_use": total - available}


def activation_bytes(cfg: ModelConfig, batch: int, tokens: int, length: int, dtype,
                     heads_split: int = 1, ffn_split: int = 1, vocab_split: int = 1,
                     fresh: bool = False, flash: bool = False) -> int:
    """A bound on what one step of `tokens` new tokens per row over `length` cache slots holds
    besides the weights and the cache, on one device (N, K split `heads_split` ways, F `ffn_split`,
    V `vocab_split`).

    One layer at its largest, every intermediate counted as live at once, times LIVE_FACTOR for
    what XLA keeps beyond one layer (measured), plus the float32 logits of the last position and
    sampling's sorted copies of them. At long prompts the attention scores can
    dominate: B * N * T * S float32 (and their probabilities in the model dtype) when
    `layers.attention` scores every slot of the cache; B * N * T * T for a `fresh` prefill (a
    prompt into an empty cache attends only among itself), and none when `flash` (cuDNN's fused
    attention, which never forms them).
    """
    a = jnp.dtype(dtype).itemsize
    B, T, S, M = batch, tokens, length, batch * tokens
    D, H = cfg.hidden_size, cfg.head_dim
    N, K = -(-cfg.num_heads // heads_split), -(-cfg.num_kv_heads // heads_split)
    V = -(-cfg.vocab_size // vocab_split)
    stream = M * D * (2 * F32 + 2 * a)  # residual, float32 norm statistics, normed input, output
    qkv = M * (N + 2 * K) * H * (F32 + 3 * a)  # float32 result, cast, rotated q and k, cache write
    if fresh:  # a prompt into an empty cache attends among its own T tokens (rotated k, v copies)
        scores = 0 if flash else B * N * T * T * (F32 + a) + B * T * T
        attention = scores + M * N * H * (F32 + a) + 2 * M * K * H * a
    else:
        attention = B * N * T * S * (F32 + a) + B * T * S + M * N * H * (F32 + a)
    ffn = 0
    for i in range(cfg.num_layers):
        if cfg.is_moe(i):
            E, A, F = cfg.num_experts, cfg.experts_per_token, -(-cfg.moe_ffn_size // ffn_split)
            routed = M * A * (D + 3 * F + D) * F32 + M * E * F32
            path = moe_path(M, A, E, decode=T == 1)
            if path == "gather":  # at most the chosen experts' weights, if the gather is not fused
                routed += M * A * 3 * F * D * a
            elif path == "dense":  # every expert's float32 output for every token
                routed += M * E * (2 * F + D) * F32
            ffn = max(ffn, routed)
        else:
            F = -(-cfg.ffn_size // ffn_split)
            ffn = max(ffn, M * (2 * F * (F32 + a) + F * a))
    logits = 4 * B * V * F32  # logits, probabilities, sorted values and their indices
    return int(LIVE_FACTOR * (stream + qkv + attention + ffn)) + logits


def resident_bytes(params: Params, device) -> int:
    """Bytes of the params held on `device` (all of them unless sharded)."""
    if params.tp is None:
        return param_bytes(params)
    total = 0
    for x in jax.tree.leaves(params):
        if device in x.sharding.device_set:
            total += math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
    return total


def _largest(fits, hi: int) -> int:
    """The largest n in [0, hi] with fits(n) (fits is monotone: true up to some n, false after)."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _devices(params: Params) -> list:
    """This process's devices that the params live on (a multi-host mesh's others have no
    statistics here)."""
    tp = params.tp
    return [d for d in tp.mesh.devices.flat if d.process_index == jax.process_index()] \
        if tp is not None else [jax.local_devices()[0]]


def request_bytes(params: Params, batch: int, tokens: int, length: int, kv_dtype=None,
                  all_logits: bool = False) -> tuple[int, int]:
    """What a request adds on each device beside the weights: (KV cache bytes, the bound on one
    step's activations) for a cache of `length` slots for `batch` rows and a prefill of `tokens`
    prompt tokens per row into it (empty); with `all_logits`, float32 logits of every position
    (`forward`'s output) among the activations."""
    cfg, tp = params.config, params.tp
    heads = tp.size if tp is not None and tp.heads else 1
    split = dict(heads_split=heads, ffn_split=tp.size if tp is not None and tp.ffn else 1,
                 vocab_split=tp.size if tp is not None and tp.vocab else 1)
    data = tp.mesh.shape[tp.batch_axis] if tp is not None and tp.batch_axis else 1
    rows = batch // data  # per device
    dtype = params.dtype
    kv = cache_bytes(cfg, rows, length, dtype, kv_dtype) // heads
    act = activation_bytes(cfg, rows, min(tokens, length), length, dtype, **split, fresh=True,
                           flash=uses_cudnn_attention(dtype, cfg.head_dim))
    if all_logits:
        act += rows * min(tokens, length) * -(-cfg.vocab_size // split["vocab_split"]) * F32
    return kv, act


def program_bytes(compiled) -> int:
    """What a compiled program allocates on each device as it runs, by XLA's own count: its
    temporaries (a KV cache it makes among them) and its outputs, less outputs that reuse an
    argument's buffer."""
    m = compiled.memory_analysis()
    return int(m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)


def check_fit(params: Params, batch: int, tokens: int, length: int, kv_dtype=None,
              allocated: Callable[[], int] | None = None, all_logits: bool = False) -> None:
    """ValueError unless a cache of `length` slots for `batch` rows and a prefill of `tokens`
    prompt tokens per row into it (empty) fit in the free memory of every device the params live on.

    `all_logits` counts float32 logits of every position, as `forward` returns them (its k and v
    stand in for the cache). `allocated`, if given, returns `program_bytes` of the compiled
    program that will serve the request, its KV cache made inside it. Where the bound says the
    request fits, that count is checked too, the activations being what it holds beyond the cache.
    The bound is an estimate, exceeded at short prompts (docs/decisions/loop-and-compiler.md#the-memory-bound-and-xlas-count).
    """
    tp = params.tp
    data = tp.mesh.shape[tp.batch_axis] if tp is not None and tp.batch_axis else 1
    exact, scale = None, 1.0

    def need(b: int, s: int) -> tuple[int, int]:  # b: rows of the whole batch
        kv, act = request_bytes(params, b, tokens, s, kv_dtype, all_logits)
        return kv, int(act * scale)

    for device in _devices(params):
        stats = memory_stats(device)
        if not stats or "bytes_limit" not in stats:
            continue
        free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        kv, act = need(batch, length)
        bound, counted = "at most ", ""
        if kv + act <= free:
            if allocated is None:
                continue
            exact = allocated() if exact is None else exact
            act_exact = max(0, exact - kv)
            if kv + act_exact <= free:
                continue
            # What fits is searched with the bound scaled to XLA's count at this request.
            scale, act, bound, counted = act_exact / max(act, 1), act_exact, "", " by XLA's count"
        max_rows = _largest(lambda b: sum(need(b * data, length)) <= free, batch // data)
        max_length = _largest(lambda s: sum(need(batch, s)) <= free, length)
        limit, weights = int(stats["bytes_limit"]), resident_bytes(params, device)
        longest = (f"{max_length} cache slots (prompt + new tokens) at batch {batch}"
                   if max_length >= tokens else f"no cache that holds the prompt at batch {batch}")
        raise ValueError(
            f"out of device memory: {batch} row(s) x {length} cache slots need {size_text(kv + act)} "
            f"on {device} (KV cache {size_text(kv)} + {bound}{size_text(act)} of activations{counted}), "
            f"but only {size_text(free)} of its {size_text(limit)} are free beside "
            f"{size_text(weights)} of weights; what fits: batch {max_rows * data} at this length, "
            f"or {longest}")


def size_text(n: int) -> str:
    """Bytes for a person: GB to two decimals, MB or KB below that."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} bytes"
