"""Roofline of one model step: per operator class, FLOPs, bytes moved and the time lower bound.

A step runs B rows of T new tokens each (T = 1 for a decode step, the prompt for a prefill) with
S cache positions filled once the step is done (S = prior context + T). For each operator class,
summed over the layers, this counts the arithmetic and the fewest bytes it must move through
device memory (every weight read once per step, the visible part of the KV cache read once, the
new K/V written once, each activation read and written once), and bounds its time by
max(flops / peak_flops, bytes / peak_bw). The step's bound is the sum of its operators' bounds
(they run one after another).

What is counted, and what is not:
- The embedding table is gathered, not streamed: a step reads only its B*T rows. With untied
  embeddings the resident weights (`param_bytes`) therefore exceed the weights a step reads.
- Logits are computed for the last position of each row only (prefill included), in float32.
- Attention counts each visible (query, key) pair once: causal, within the sliding window where
  a layer has one, never the padding or the unused tail of a preallocated cache.
- MoE experts: every token runs A experts; the bytes are those of the distinct experts the step
  touches, E * (1 - (1 - A/E)^(B*T)) per layer in expectation under uniform routing.
- Integer weights (`dtype="int8"`) carry one bfloat16 scale per output channel; activations then
  stay bfloat16. An int8 KV cache carries one bfloat16 scale per position and KV head.
- Elementwise work (norms, RoPE, SiLU, softmax, residual adds) is in the FLOP counts of no row:
  it is memory-bound and its bytes sit in the `norms` row and in each operator's activations.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from jaxllm.model.config import INT32_MAX, ModelConfig
from jaxllm.model.params import abstract_params, param_bytes

# One H200 (SXM). Datasheet HBM3e bandwidth; bf16 dense matmul and device-to-device copy as measured
# on one such machine (KINDS.md: 769-798 TFLOP/s on random data for an 8192-cube product; copy
# ~4.3 TB/s counting bytes read and written). Callers pass their own peaks when they measure them.
H200_HBM_BW = 4.8e12
H200_COPY_BW = 4.3e12
H200_BF16_MATMUL_FLOPS = 790e12

# The largest batch, context or token count taken: int32, as the arrays that index them.
MAX_SIZE = INT32_MAX

OPS = ("embed", "norms", "qkv", "attention", "o", "gate_up", "down", "router", "experts", "lm_head")


def _itemsize(dtype) -> int:
    return jnp.dtype(dtype).itemsize


def _visible_pairs(prior: int, total: int, window: int | None) -> int:
    """Sum over query positions p in [prior, total) of the keys it sees: min(p + 1, window)."""
    def upto(n):  # sum_{q=1}^{n} min(q, window)
        if window is None or n <= window:
            return n * (n + 1) // 2
        return window * (window + 1) // 2 + (n - window) * window
    return upto(total) - upto(prior)


def _visible_keys(prior: int, total: int, window: int | None) -> int:
    """Distinct key positions the queries at [prior, total) see: the union of their windows."""
    first = 0 if window is None else max(0, prior - window + 1)
    return total - first


def analyze(cfg: ModelConfig, batch: int, context: int, tokens: int = 1, dtype="bfloat16",
            kv_dtype=None, peak_bw: float = H200_HBM_BW, peak_flops: float = H200_BF16_MATMUL_FLOPS,
            name: str | None = None) -> dict:
    """The roofline of one step: {"setup": {...}, "ops": [one dict per operator class], "totals": {...}}.

    `context` is S, the cache positions filled after the step (raised to `tokens` if smaller);
    `dtype` is the weights' dtype ("int8" for weight-only quantization), `kv_dtype` the cache's
    (default: the activations' dtype).
    """
    B, T = int(batch), int(tokens)
    if B < 1 or T < 1:
        raise ValueError(f"batch and tokens must be >= 1, got batch={batch}, tokens={tokens}")
    if int(context) < 0:
        raise ValueError(f"context must be >= 0 cache positions, got {context}")
    for label, value in (("batch", B), ("tokens", T), ("context", int(context))):
        if value > MAX_SIZE:  # past it the counts overflow a float's conversion, and no step is that big
            raise ValueError(f"{label} must be at most {MAX_SIZE} (int32), got {value}")
    for label, peak in (("peak_bw", peak_bw), ("peak_flops", peak_flops)):
        if not 0 < peak < math.inf:
            raise ValueError(f"{label} must be a positive, finite rate, got {peak}")
    for label, d in (("dtype", dtype), ("kv_dtype", kv_dtype)):
        if d is not None and jnp.dtype(d) not in (jnp.bfloat16, jnp.float16, jnp.float32, jnp.int8):
            raise ValueError(f"{label} must be bfloat16, float16, float32 or int8, got {jnp.dtype(d)}")
    S = max(int(context), T)
    P = S - T  # positions already in the cache before the step
    M = B * T  # tokens through every projection
    quantized = jnp.issubdtype(jnp.dtype(dtype), jnp.integer)
    w = _itemsize(dtype)
    act_dtype = jnp.bfloat16 if quantized else dtype
    a = _itemsize(act_dtype)
    kv_dtype = act_dtype if kv_dtype is None else kv_dtype
    kv = _itemsize(kv_dtype)
    kv_scale = 2 if jnp.issubdtype(jnp.dtype(kv_dtype), jnp.integer) else 0  # bf16 per position, head

    D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    V = cfg.vocab_size

    def matrix(rows_out: int, cols_in: int) -> int:
        """Bytes of one [out, in] weight, with per-output-channel scales when quantized."""
        return rows_out * cols_in * w + (rows_out * 2 if quantized else 0)

    rows = {op: dict(flops=0, weight_bytes=0, kv_read_bytes=0, kv_write_bytes=0, act_bytes=0)
            for op in OPS}

    def add(op, flops=0, weight=0, kv_read=0, kv_write=0, act=0):
        r = rows[op]
        r["flops"] += flops
        r["weight_bytes"] += weight
        r["kv_read_bytes"] += kv_read
        r["kv_write_bytes"] += kv_write
        r["act_bytes"] += act

    add("embed", weight=min(M, V) * D * a, act=M * D * a)
    for i in range(cfg.num_layers):
        window = cfg.sliding_window if cfg.is_sliding(i) else None
        qkv_out = (N + 2 * K) * H
        # Two RMSNorms per layer, four with Gemma's post-norms (plus per-head q/k norms): weights,
        # and x read + h written each.
        norms = 4 if cfg.post_norms else 2
        add("norms", weight=norms * D * a + (2 * H * a if cfg.qk_norm else 0), act=norms * 2 * M * D * a)
        add("qkv", flops=2 * M * D * qkv_out,
            weight=matrix(qkv_out, D) + (qkv_out * a if cfg.qkv_bias else 0),
            act=M * D * a + M * qkv_out * a)
        per_position = K * H * kv + K * kv_scale  # one of k or v, one row
        add("attention", flops=4 * B * _visible_pairs(P, S, window) * N * H,
            kv_read=2 * B * _visible_keys(P, S, window) * per_position,
            kv_write=2 * M * per_position, act=2 * M * N * H * a)
        add("o", flops=2 * M * N * H * D, weight=matrix(D, N * H) + (D * a if cfg.o_bias else 0),
            act=M * N * H * a + M * D * a)
        if cfg.is_moe(i):
            E, A, F = cfg.num_experts, cfg.experts_per_token, cfg.moe_ffn_size
            touched = E * (1.0 - (1.0 - A / E) ** M)
            add("router", flops=2 * M * D * E, weight=matrix(E, D), act=M * D * a + M * E * 4)
            add("experts", flops=2 * M * A * 3 * D * F,
                weight=round(touched * (matrix(2 * F, D) + matrix(D, F))),
                act=M * A * (D + 2 * F + F + D) * a)
        else:
            F = cfg.ffn_size
            add("gate_up", flops=2 * M * D * 2 * F, weight=matrix(2 * F, D), act=M * D * a + M * 2 * F * a)
            # SiLU(gate) * up is fused into the down projection's input: it reads both halves.
            add("down", flops=2 * M * F * D, weight=matrix(D, F), act=M * 2 * F * a + M * D * a)
    add("norms", weight=D * a, act=2 * B * D * a)  # final norm, last position only
    # Logits for the last position of each row, float32 out.
    add("lm_head", flops=2 * B * D * V, weight=matrix(V, D), act=B * D * a + B * V * 4)

    ops = []
    for op in OPS:
        r = rows[op]
        if op in ("router", "experts") and not cfg.num_experts:
            continue
        if op in ("gate_up", "down") and all(cfg.is_moe(i) for i in range(cfg.num_layers)):
            continue
        nbytes = r["weight_bytes"] + r["kv_read_bytes"] + r["kv_write_bytes"] + r["act_bytes"]
        t_flops, t_bytes = r["flops"] / peak_flops, nbytes / peak_bw
        ops.append(dict(op=op, **r, bytes=nbytes, intensity=r["flops"] / nbytes if nbytes else 0.0,
                        time_flops_s=t_flops, time_bytes_s=t_bytes, time_lb_s=max(t_flops, t_bytes),
                        bound="compute" if t_flops > t_bytes else "memory"))

    def total(key):
        return sum(o[key] for o in ops)

    step_s = total("time_lb_s")
    totals = dict(flops=total("flops"), bytes=total("bytes"), weight_bytes=total("weight_bytes"),
                  kv_read_bytes=total("kv_read_bytes"), kv_write_bytes=total("kv_write_bytes"),
                  act_bytes=total("act_bytes"), time_lb_s=step_s,
                  time_flops_s=total("flops") / peak_flops, time_bytes_s=total("bytes") / peak_bw,
                  tokens_per_s_lb=M / step_s,
                  param_bytes=_resident_param_bytes(cfg, dtype, quantized),
                  kv_cache_bytes=2 * cfg.num_layers * B * S * (K * H * kv + K * kv_scale))
    totals["intensity"] = totals["flops"] / totals["bytes"]
    for o in ops:
        o["share"] = o["time_lb_s"] / step_s
    setup = dict(name=name, batch=B, context=S, tokens=T, dtype=str(jnp.dtype(dtype)),
                 kv_dtype=str(jnp.dtype(kv_dtype)), peak_bw=peak_bw, peak_flops=peak_flops)
    return dict(setup=setup, ops=ops, totals=totals)


def _resident_param_bytes(cfg: ModelConfig, dtype, quantized: bool) -> int:
    """Bytes of all weights held on the device (the declared parameter table, whole embedding)."""
    if not quantized:
        return param_bytes(abstract_params(cfg, dtype))
    return param_bytes(abstract_params(cfg, jnp.int8))  # scales are under 0.1% and not counted here


def format_table(result: dict) -> str:
    """A fixed-width table of `analyze`'s result, one row per operator class and a total; a column
    widens where a number needs it (a huge batch or context), so the columns stay aligned."""
    s, t = result["setup"], result["totals"]
    head = (f"roofline {s['name'] or ''}  B={s['batch']} T={s['tokens']} S={s['context']}  "
            f"weights {s['dtype']}, KV {s['kv_dtype']}  peaks {s['peak_bw'] / 1e12:.2f} TB/s, "
            f"{s['peak_flops'] / 1e12:.0f} TFLOP/s")

    def cells(name, r, share, bound):
        kv_mb = (r["kv_read_bytes"] + r["kv_write_bytes"]) / 1e6
        return [name, f"{r['flops'] / 1e9:.2f}", f"{r['weight_bytes'] / 1e6:.1f}", f"{kv_mb:.1f}",
                f"{r['act_bytes'] / 1e6:.2f}", f"{r['intensity']:.1f}", f"{r['time_lb_s'] * 1e6:.1f}",
                f"{share * 100:.1f}%", bound]

    titles = ["op", "GFLOP", "weights MB", "KV MB", "act MB", "FLOP/B", "bound us", "share", "limit"]
    widths = [10, 11, 12, 10, 10, 9, 11, 7, 0]  # the least each column takes, its gap included
    body = [cells(o["op"], o, o["share"], o["bound"]) for o in result["ops"]]
    total = cells("total", t, 1.0, "")
    for row in [titles, *body, total]:
        widths = [max(w, len(c) + (i > 0)) for i, (w, c) in enumerate(zip(widths, row))]

    def line(row):
        out = f"{row[0]:<{widths[0]}}" + "".join(f"{c:>{w}}" for c, w in zip(row[1:-1], widths[1:-1]))
        return (out + f"  {row[-1]}").rstrip()

    cols = line(titles)
    rule = "-" * len(cols)
    lines = [head, cols, rule, *map(line, body), rule, line(total)]
    lines.append(f"step >= {t['time_lb_s'] * 1e3:.3f} ms: at most {t['tokens_per_s_lb']:.0f} tokens/s "
                 f"in total; {t['bytes'] / 1e9:.3f} GB moved per step; resident weights "
                 f"{t['param_bytes'] / 1e9:.3f} GB, KV cache at S={s['context']} {t['kv_cache_bytes'] / 1e9:.3f} GB")
    return "\n".join(lines)


def _dtype_name(name: str) -> str:
    return {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(name, name)
