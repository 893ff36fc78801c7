#!/usr/bin/env python
"""Check the GPU-only code paths on a GPU, where CI (CPU) cannot: exit 1 if one is off.

    python scripts/gpu_check.py [SECTION ...]   # decode_project rows_project decode_attention
                                                # add_norm attention fresh_prefill generate_loop
                                                # moe route swiglu sharded

- `layers.causal_attention` through cuDNN against float32, with and without a sliding window;
- a prefill into an empty cache (rotated rows, cuDNN) against the cache-reading prefill, on a
  ragged batch at real model widths: logits, the next decode step, the cache it wrote;
- the Pallas decode-attention kernel against float32 XLA attention (rows of different starts,
  long caches split over programs, batch 32 in one split, a sliding window, Qwen3's head
  norms), and decode steps through it against XLA's masked form at real model widths;
- `kernels.project` (norm, matrix-vector product and epilogue in one Pallas kernel; bf16 and
  int8 weights; the o projection from uncombined attention splits; an int8 gate/up and a large
  int8 lm_head from `add_norm`'s int8 digits, and down from gate/up's, on tensor cores)
  against float32 XLA at Qwen3-0.6B and SmolLM2 widths, int8 at the 8B shape's, and batch-1
  decode through it (splits combined in the o projection);
- `kernels.rows_project` (a decode step of 8-32 rows: each matrix on tensor cores with its bias,
  residual or SwiGLU) against float32 XLA at the 8B shape's and Qwen3-0.6B's widths, and decode
  steps of 32 rows (16 for the 8B shape too) through it against XLA's;
- `kernels.add_norm` (residual add and RMSNorm in one pass) against float32, and a prefill
  through it (then decode steps reading its cache) against XLA;
- every MoE path (gather, dense, ragged with the Mosaic GPU grouped GEMM, ragged with XLA's
  ragged_dot) against the dense path in float32, at Mixtral and Qwen3-30B-A3B layer shapes;
- `kernels.route` (a MoE layer's softmax and top-k) against XLA's routing, and prefill and
  batch-1 decode of MoE models of real widths routed by it;
- the gathered experts' SwiGLU in one variadic reduction against a reduction and a multiply
  after it: the same bits in decode steps and generate (Qwen3-30B-A3B in bf16 and int8, Mixtral);
- on 2 GPUs or more, models split over two of them (tensor parallel) against one GPU.
Bounds are a few times the bf16 errors seen on an H200 (2026-11-29): attention 3.5e-3, prefill
logits 1.5e-2, MoE 7.2e-3.
"""

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxllm
from jaxllm import kernels
from jaxllm.layers import dense as L
from jaxllm.layers.quant import quantize
from jaxllm.model import transformer as model
from jaxllm.model.cache import init_cache
from jaxllm.model.params import quantize_params
from jaxllm.tools.presets import PRESETS, random_params

failures = []


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / (np.abs(b).max() + 1e-12))


def check(name: str, err: float, bound: float):
    ok = err <= bound
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {err:.2e} (bound {bound:.0e})", flush=True)
    if not ok:
        failures.append(name)


def _ragged_batch(name: str, seed: int):
    """A 4-layer model of a preset's widths (random weights) and 3 prompts of 256 slots that
    start at 0, 100 and 255: (config, params, tokens, start)."""
    cfg = dataclasses.replace(PRESETS[name], num_layers=4)
    tokens = jax.random.randint(jax.random.key(seed), (3, 256), 0, cfg.vocab_size)
    return cfg, random_params(cfg), tokens, jnp.asarray([0, 100, 255], jnp.int32)


def _with_switches(switches: dict, run, module=kernels):
    """run() with the module flags of `module` (`kernels` by default) set as `switches` says, jit
    caches cleared around it, the flags restored after."""
    saved = {name: getattr(module, name) for name in switches}
    for name, value in switches.items():
        setattr(module, name, value)
    jax.clear_caches()
    try:
        return run()
    finally:
        for name, value in saved.items():
            setattr(module, name, value)
        jax.clear_caches()


def _prefill_and_decode(cfg, params, tokens, start):
    """A fresh prefill of `tokens`, then 8 decode steps of the same tokens: (logits [B, 8, V],
    layer 3's cache k at the 8 new slots)."""
    step = jax.jit(model.step, static_argnames="fresh")
    cache = init_cache(cfg, tokens.shape[0], 320, params.dtype, start)
    logits, cache = step(params, tokens, cache, fresh=True)
    steps = []
    for t in range(8):  # the same tokens in every run, so the steps stay comparable
        logits, cache = step(params, tokens[:, t:t + 1], cache)
        steps.append(logits)
    return jnp.stack(steps, 1), cache.k[3][:, :, 256:264]


def _decode_both_ways(cfg, params, tokens, start, switches):
    """`_prefill_and_decode` with the kernels named by `switches` (module flags of `kernels`) on
    ("auto"), then off ("xla"): {mode: (logits [B, 8, V], layer 3's cache k at the 8 new slots)}."""
    run = lambda: _prefill_and_decode(cfg, params, tokens, start)
    return {mode: _with_switches(dict.fromkeys(switches, mode), run) for mode in ("auto", "xla")}


def attention():
    attend = jax.jit(L.causal_attention, static_argnums=3)
    for T, window, H in [(16, None, 64), (300, None, 128), (2048, None, 128), (300, 64, 128), (1024, 4, 64)]:
        keys = jax.random.split(jax.random.key(T), 3)
        q = jax.random.normal(keys[0], (2, T, 8, H), jnp.bfloat16)
        k = jax.random.normal(keys[1], (2, T, 2, H), jnp.bfloat16)
        v = jax.random.normal(keys[2], (2, T, 2, H), jnp.bfloat16)
        assert L.uses_cudnn_attention(q.dtype, H)
        want = attend(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), window)
        check(f"cuDNN attention T={T} window={window} H={H}", rel(attend(q, k, v, window), want), 1e-2)


def fresh_prefill():
    step = jax.jit(model.step, static_argnames="fresh")
    for name in ["qwen3-0.6b", "llama3.2-1b"]:
        cfg, params, tokens, start = _ragged_batch(name, seed=1)
        outs = {}
        for fresh in (True, False):
            logits, cache = step(params, tokens, init_cache(cfg, 3, 320, params.dtype, start), fresh=fresh)
            after, cache = step(params, jnp.argmax(logits, -1)[:, None].astype(jnp.int32), cache)
            outs[fresh] = logits, after, cache.k[2][1, :, 100:256]
        for what, i, bound in [("logits", 0, 3e-2), ("next step", 1, 3e-2), ("cache k", 2, 3e-2)]:
            check(f"{name} fresh prefill vs cache-reading, {what}", rel(outs[True][i], outs[False][i]), bound)
        same = bool(jnp.all(jnp.argmax(outs[True][0], -1) == jnp.argmax(outs[False][0], -1)))
        check(f"{name} fresh prefill, a greedy token differs (1 = yes)", float(not same), 0)


def decode_attention():
    def reference(qkv, k_cache, v_cache, end, start, inv_freq, window, q_norm, k_norm):
        B, K, J, H = qkv.shape
        G, positions = J - 2, (end - start)[:, None]
        q, k, v = qkv[:, :, :G].reshape(B, 1, K * G, H), qkv[:, None, :, G], qkv[:, None, :, G + 1]
        if q_norm is not None:
            q, k = L.rms_norm(q, q_norm, 1e-6), L.rms_norm(k, k_norm, 1e-6)
        q, k = L.rope(q, positions, inv_freq), L.rope(k, positions, inv_freq)
        k_cache, v_cache = (c.at[jnp.arange(B), :, end].set(x[:, 0]) for c, x in ((k_cache, k), (v_cache, v)))
        mask = L.visible_mask(end[:, None], start, k_cache.shape[2], window)
        return L.attention(q.reshape(B, 1, K, G, H), k_cache, v_cache, mask)[:, 0], k_cache

    for B, K, G, H, S, furthest, window, norm in [(1, 8, 4, 128, 384, 300, None, False),
                                                  (1, 3, 3, 64, 384, 200, None, False),
                                                  (4, 8, 4, 128, 8448, 8000, None, False),
                                                  (2, 8, 2, 128, 8448, 500, None, True),
                                                  (32, 8, 4, 128, 384, 383, 100, False),
                                                  (32, 8, 4, 128, 2304, 2100, None, False)]:
        keys = jax.random.split(jax.random.key(S + furthest), 5)
        qkv = jax.random.normal(keys[0], (B, K, G + 2, H), jnp.bfloat16)
        caches = [jax.random.normal(k, (B, K, S, H), jnp.bfloat16) for k in keys[1:3]]
        norms = [1 + 0.1 * jax.random.normal(k, (H,), jnp.bfloat16) for k in keys[3:]] if norm else [None, None]
        start = jnp.arange(B, dtype=jnp.int32) * 7 % 50
        end = furthest - jnp.arange(B, dtype=jnp.int32) * 5 % 30  # ragged rows, the first at `furthest`
        inv_freq = jnp.asarray(1.0 / 500000 ** (np.arange(0, H, 2) / H), jnp.float32)
        angles = jnp.arange(S, dtype=jnp.float32)[:, None] * inv_freq  # by position, as generate's
        f32 = lambda xs: [None if x is None else x.astype(jnp.float32) for x in xs]
        want, want_k = jax.jit(reference, static_argnums=6)(
            *f32([qkv, *caches]), end, start, inv_freq, window, *f32(norms))
        rotation = jnp.stack([jnp.cos(angles), jnp.sin(angles)], axis=1)
        got, got_k, _ = kernels.decode_attention(qkv, *caches, end, start, rotation,
                                                 window=window, q_norm_H=norms[0],
                                                 k_norm_H=norms[1], eps=1e-6)
        name = f"decode attention B={B} K={K} G={G} H={H} S={S} ends<={furthest} window={window} norm={norm}"
        check(name, rel(got, want), 1e-2)
        check(name + ", cache k", rel(got_k, want_k), 1e-2)

    # A loop's table made once (generate, stream) against each step's own (decode_step alone).
    cfg, params, tokens, start = _ragged_batch("qwen3-0.6b", seed=3)
    step = jax.jit(model.step, static_argnames="fresh")
    runs = []
    for rotation in (None, model.rotation_table(cfg, 320)):
        cache = init_cache(cfg, tokens.shape[0], 320, params.dtype, start)
        logits, cache = step(params, tokens, cache, fresh=True)
        steps = []
        for t in range(4):
            logits, cache = step(params, tokens[:, t:t + 1], cache, rotation=rotation)
            steps.append(logits)
        runs.append(jnp.stack(steps, 1))
    check("qwen3-0.6b decode, the rotation table made once as each step's",
          rel(runs[1], runs[0]), 0)

    for name in ["qwen3-0.6b", "llama3.2-1b"]:
        outs = _decode_both_ways(*_ragged_batch(name, seed=2), ["DECODE_ATTENTION"])
        check(f"{name} decode via the kernel vs XLA, logits", rel(outs["auto"][0], outs["xla"][0]), 3e-2)
        check(f"{name} decode via the kernel vs XLA, cache k", rel(outs["auto"][1], outs["xla"][1]), 3e-2)


def decode_project():
    bf16, f32 = jnp.bfloat16, jnp.float32
    upcast = lambda a: a.astype(f32) if a.dtype == bf16 else a
    # Qwen3-0.6B's and SmolLM2's widths, and the 8B shape's, whose matrices take the kernel in
    # int8 only (in INT8_TILES: the down projection's 14336 channels in whole chunks of 2048).
    for D, N, F in [(1024, 4096, 3072), (576, 960, 1536), (4096, 6144, 14336)]:
        keys = jax.random.split(jax.random.key(D), 7)
        w = jax.random.normal(keys[0], (N, D), bf16) * D ** -0.5
        w_gate_up = jax.random.normal(keys[1], (2, F, D), bf16) * D ** -0.5
        w_down = jax.random.normal(keys[2], (D, F), bf16) * F ** -0.5
        g, b = 1 + 0.1 * jax.random.normal(keys[3], (D,), bf16), jax.random.normal(keys[4], (N,), bf16)
        x = jax.random.normal(keys[5], (1, D), bf16)  # the kernel takes batch-1 steps
        act = jax.random.normal(keys[6], (1, F), bf16)
        cases = [("norm + qkv + bias", x, w, dict(norm_C=g, bias_N=b)),
                 ("norm + gate/up + swiglu", x, w_gate_up, dict(norm_C=g, swiglu=True)),
                 ("down + residual", act, w_down, dict(residual_MN=x)),
                 ("norm + head, float32", x, w, dict(norm_C=g, out_dtype=f32))]
        cases += [(f"int8 {name}", a, quantize(m), kw) for name, a, m, kw in cases[1:3]]
        if D == 4096:
            cases = [("int8 norm + qkv", x, quantize(w), dict(norm_C=g))] + cases[-2:]
        for name, a, m, kw in cases:
            got = kernels.project(a, m, mode="gpu", **kw)
            arrays = {k: v for k, v in kw.items() if isinstance(v, jax.Array)}
            static = {k: v for k, v in kw.items() if k not in arrays}
            m32 = m.replace(dtype=f32) if hasattr(m, "q") else m  # int8 values, float32 scale
            want = kernels.project(upcast(a), jax.tree.map(upcast, m32), mode=None,
                                   **jax.tree.map(upcast, arrays), **static)
            check(f"decode project D={D} {name}", rel(got, want), 2e-2)
        if D == 4096:  # gate/up from add_norm's int8 digits, on tensor cores (INT8_DIGITS)
            w_int8 = quantize(w_gate_up)
            _, row = kernels.add_norm(x, jnp.zeros_like(x), g, 1e-5, mode="gpu", digits=True)
            got = kernels.project(row, w_int8, swiglu=True, mode="gpu")
            want = kernels.project(upcast(x), w_int8.replace(dtype=f32), norm_C=upcast(g), eps=1e-5,
                                   swiglu=True)
            taken = isinstance(row, kernels.DigitRow) and kernels.project_digits(w_int8, "gpu", True)
            check(f"decode project D={D} int8 gate/up + swiglu from add_norm's digits"
                  f"{'' if taken else ' (NOT TAKEN)'}", rel(got, want) if taken else 1.0, 2e-2)
            # an int8 lm_head past KERNEL_MAX_INT8_WEIGHTS from the final norm's digits
            head = quantize(jax.random.normal(keys[0], (40960, D), bf16) * D ** -0.5)
            got = kernels.project(row, head, mode="gpu", out_dtype=f32)
            want = kernels.project(upcast(x), head.replace(dtype=f32), norm_C=upcast(g), eps=1e-5,
                                   out_dtype=f32)
            taken = kernels.project_digits(head, "gpu") or not kernels.INT8_HEAD_DIGITS
            check(f"decode project D={D} int8 lm_head, float32, from add_norm's digits"
                  f"{'' if taken else ' (NOT TAKEN)'}", rel(got, want) if taken else 1.0, 2e-2)
            # down from the digits that gate/up's kernel writes of its output (INT8_DOWN_DIGITS)
            w_down_int8 = quantize(w_down)
            bounds = kernels.down_bounds([w_int8])
            act = kernels.project(row, w_int8, swiglu=True, mode="gpu", down_digits_of=(bounds, 0))
            taken = isinstance(act, kernels.DigitRow) and kernels.down_digits(w_down_int8, "gpu")
            got = kernels.project(act, w_down_int8, mode="gpu")
            plain = kernels.project(row, w_int8, swiglu=True, mode="gpu")
            same = taken and np.array_equal(np.asarray(act.x), np.asarray(plain))
            want = kernels.project(upcast(act.x if taken else plain),
                                   w_down_int8.replace(dtype=f32))
            check(f"decode project D={D} int8 down from gate/up's digits (gate/up's output the same"
                  f" bits){'' if taken else ' (NOT TAKEN)'}", rel(got, want) if same else 1.0, 2e-2)

    for K, G, H, D in [(8, 2, 128, 1024), (3, 3, 64, 576)]:  # o from uncombined attention splits
        keys = jax.random.split(jax.random.key(K * H), 5)
        acc = jax.random.normal(keys[0], (1, 6, K, G, H), f32)
        m, l = jax.random.normal(keys[1], (1, 6, K, G), f32), 1 + jax.random.uniform(keys[2], (1, 6, K, G))
        wo = jax.random.normal(keys[3], (D, K * G * H), bf16) * (K * G * H) ** -0.5
        x = jax.random.normal(keys[4], (1, D), bf16)
        got = kernels.project(kernels.SplitHeads(acc, m, l, dtype=bf16), wo, residual_MN=x, mode="gpu")
        want = kernels.project(kernels.SplitHeads(acc, m, l, dtype=f32), wo.astype(f32), residual_MN=x.astype(f32))
        check(f"decode project D={D} o + residual from 6 attention splits", rel(got, want), 2e-2)

    # Batch-1 decode through both kernels, against XLA; Llama-3.2-1B's FFN and the 8B shape's
    # matrices are too large for project's kernel: their norms go through add_norm's. In int8 the
    # 8B shape's matrices take project's kernel, their norms still add_norm's (INT8_NORM_APART),
    # but gate/up and the lm_head, which take add_norm's digits on tensor cores (INT8_DIGITS).
    for name, int8 in [("qwen3-0.6b", False), ("llama3.2-1b", False), ("llama3-8b", False),
                       ("llama3-8b", True)]:
        cfg, params, tokens, start = _ragged_batch(name, seed=3)
        params = quantize_params(params) if int8 else params
        outs = _decode_both_ways(cfg, params, tokens[1:2], start[1:2],
                                 ["DECODE_ATTENTION", "DECODE_PROJECT"])
        check(f"{name}{' int8' if int8 else ''} batch-1 decode via both kernels vs XLA, logits",
              rel(outs["auto"][0], outs["xla"][0]), 3e-2)


def rows_project():
    bf16, f32 = jnp.bfloat16, jnp.float32
    upcast = lambda a: a.astype(f32)
    for D, N, F in [(4096, 6144, 14336), (1024, 4096, 3072)]:
        keys = jax.random.split(jax.random.key(D), 8)
        w = jax.random.normal(keys[0], (N, D), bf16) * D ** -0.5
        wo = jax.random.normal(keys[1], (D, N), bf16) * N ** -0.5
        w_gate_up = jax.random.normal(keys[2], (2, F, D), bf16) * D ** -0.5
        w_down = jax.random.normal(keys[3], (D, F), bf16) * F ** -0.5
        g = 1 + 0.1 * jax.random.normal(keys[4], (D,), bf16)
        b = jax.random.normal(keys[5], (N,), bf16)
        for M in (kernels.ROWS_MAX, 5):
            x = jax.random.normal(keys[6], (M, D), bf16)
            heads = jax.random.normal(keys[7], (M, N), bf16)
            act = jax.random.normal(keys[7], (M, F), bf16)
            cases = [("norm + qkv + bias", x, w, dict(norm_C=g, bias_N=b)),
                     ("o + residual", heads, wo, dict(residual_MN=x)),
                     ("norm + gate/up + swiglu", x, w_gate_up, dict(norm_C=g, swiglu=True)),
                     ("down + residual", act, w_down, dict(residual_MN=x))]
            for name, a, m, kw in cases:
                taken = kernels.rows_takes(m, "gpu", kw.get("swiglu", False))
                got = kernels.rows_project(a, m, mode="gpu", eps=1e-5, **kw)
                want = kernels.rows_project(
                    upcast(a), upcast(m), eps=1e-5,
                    **{k: upcast(v) if isinstance(v, jax.Array) else v for k, v in kw.items()})
                check(f"rows project {M}x{D} {name}{'' if taken else ' (NOT TAKEN)'}",
                      rel(got, want) if taken else 1.0, 2e-2)
    # Decode steps of 32 rows (and 16, the 8B shape's, whose kernels give no PDL signal) through
    # every kernel, against XLA's: the ragged batch's 3 prompts over and over.
    for name, rows in [("qwen3-0.6b", 32), ("llama3.2-1b", 32), ("llama3-8b", 32), ("llama3-8b", 16)]:
        cfg, params, tokens, start = _ragged_batch(name, seed=5)
        tokens, start = jnp.tile(tokens, (11, 1))[:rows], jnp.tile(start, 11)[:rows]
        assert model._rows_mode(params, rows, 1) == "gpu", name
        outs = _decode_both_ways(cfg, params, tokens, start, ["DECODE_ATTENTION", "ROWS_PROJECT"])
        check(f"{name} {rows}-row decode via rows_project vs XLA, logits",
              rel(outs["auto"][0], outs["xla"][0]), 3e-2)
    # Its kernels let the next one launch early (kernels.PDL_TRIGGER): a kernel that read its input
    # before the one ahead had written it would change the tokens of a 32-row generate.
    cfg = PRESETS["smollm2-135m"]
    params = random_params(cfg, 0, jnp.bfloat16)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (32, 20))
    assert model._rows_mode(params, 32, 1) == "gpu"
    run = lambda: np.asarray(
        jaxllm.generate(params, ids, max_new_tokens=40, eos_token_ids=[]).tokens)
    unsignalled = _with_switches({"PDL_TRIGGER": False}, run)
    check("32-row generate with kernels signalling their dependents early, a token differs "
          "(1 = yes)", float(not (run() == unsignalled).all()), 0)


def add_norm():
    bf16, f32 = jnp.bfloat16, jnp.float32
    for M, C in [(2048, 4096), (32, 4096), (3, 576), (5, 896)]:  # long, short prompts; odd widths
        keys = jax.random.split(jax.random.key(M + C), 3)
        x, delta = (jax.random.normal(k, (M, C), bf16) for k in keys[:2])
        g = 1 + 0.1 * jax.random.normal(keys[2], (C,), bf16)
        got = kernels.add_norm(x, delta, g, 1e-5, mode="gpu")
        want = kernels.add_norm(x.astype(f32), delta.astype(f32), g.astype(f32), 1e-5)
        check(f"add_norm {M}x{C}, sum", rel(got[0], want[0]), 1e-2)
        check(f"add_norm {M}x{C}, normed", rel(got[1], want[1]), 2e-2)
    for name in ["qwen3-0.6b", "llama3.2-1b"]:  # a ragged prefill through the kernel, then decode
        outs = _decode_both_ways(*_ragged_batch(name, seed=4), ["ADD_NORM"])
        check(f"{name} prefill + decode via add_norm vs XLA, logits",
              rel(outs["auto"][0], outs["xla"][0]), 3e-2)


def moe():
    for E, A, D, F in [(8, 2, 4096, 14336), (128, 8, 2048, 768)]:
        keys = jax.random.split(jax.random.key(E), 4)
        router = jax.random.normal(keys[0], (E, D), jnp.bfloat16) * 0.05
        gate_up = jax.random.normal(keys[1], (E, 2, F, D), jnp.bfloat16) * 0.02
        down = jax.random.normal(keys[2], (E, D, F), jnp.bfloat16) * 0.02
        f32 = [w.astype(jnp.float32) for w in (router, gate_up, down)]
        for M in [1, 8, 64, 700]:
            x = jax.random.normal(keys[3], (1, M, D), jnp.bfloat16)
            want = L.moe(x.astype(jnp.float32), *f32, A, True, path="dense")
            for path, grouped in [("gather", "auto"), ("dense", "auto"), ("ragged", "auto"), ("ragged", "xla")]:
                if path == "gather" and M > 64:
                    continue
                L.GROUPED_GEMM = grouped
                got = jax.jit(lambda *w, p=path: L.moe(*w, A, True, path=p))(x, router, gate_up, down)
                check(f"MoE E={E} A={A} M={M} {path}{' (XLA ragged_dot)' if grouped == 'xla' else ''}",
                      rel(got, want), 2e-2)
            L.GROUPED_GEMM = "auto"


def route():
    """`kernels.route` (a MoE layer's softmax and top-k in one kernel a token) against XLA's:
    the same experts in the same order, the same weights to float32 rounding; then 4-layer
    models of the MoE presets' widths, a prefill and batch-1 decode steps routed by the kernel
    against XLA's routing, and generate's tokens unchanged with the PDL signals off."""
    for E, A, norm in [(8, 2, True), (128, 8, True), (60, 4, False)]:
        for M in [1, 16, 2048]:
            keys = jax.random.split(jax.random.key(E * M), 2)
            x = jax.random.normal(keys[0], (M, 2048), jnp.bfloat16).at[0].set(0)  # row 0: all tie
            router = jax.random.normal(keys[1], (E, 2048), jnp.bfloat16) * 0.05
            # The same bf16 logits into both (XLA may keep a fused product's excess precision).
            logits = jax.jit(L.router_logits)(x, router)
            want = jax.jit(L.pick_experts, static_argnums=(1, 2))(logits, A, norm)
            got = kernels.pick_experts(logits, A, norm)
            check(f"route E={E} A={A} M={M}: experts not as XLA's (fraction)",
                  float(np.mean(np.asarray(got[0]) != np.asarray(want[0]))), 0)
            check(f"route E={E} A={A} M={M}: weights", rel(got[1], want[1]), 1e-5)
    # Not the same bits: the kernel takes the logits rounded to bf16 (as transformers' linear
    # layer gives them), where XLA's fusion may keep its product's float32 (1.45e-2 and 8.6e-3
    # on an H200, 2026-12-01), so the bound is that of the other kernels' model-level checks.
    for name in ["mixtral-8x7b", "qwen3-30b-a3b"]:
        cfg, params, tokens, start = _ragged_batch(name, seed=6)
        outs = _decode_both_ways(cfg, params, tokens[:1], start[:1], ["ROUTE"])
        check(f"{name} prefill + batch-1 decode routed by the kernel vs XLA, logits",
              rel(outs["auto"][0], outs["xla"][0]), 3e-2)
        ids = [np.asarray(tokens[0, :40]).tolist()]
        run = lambda: np.asarray(jaxllm.generate(params, ids, max_new_tokens=24, eos_token_ids=[]).tokens)
        check(f"{name} generate with kernels signalling their dependents early, a token differs (1 = yes)",
              float(not (_with_switches({"PDL_TRIGGER": False}, run) == run()).all()), 0)


def swiglu():
    """The gathered experts' SwiGLU as one variadic reduction (`layers.MOE_SWIGLU_REDUCE`) against
    one reduction and a multiply kernel: the same bits. 4-layer models of the MoE presets' widths
    (Qwen3-30B-A3B in bf16 and int8, Mixtral-8x7B), a prefill and batch-1 decode steps, then
    generate."""
    def on_and_off(run):  # run() with the switch on (as it stands), then off
        return run(), _with_switches({"MOE_SWIGLU_REDUCE": False}, run, module=L)
    for name, int8 in [("qwen3-30b-a3b", False), ("qwen3-30b-a3b", True), ("mixtral-8x7b", False)]:
        cfg, params, tokens, start = _ragged_batch(name, seed=7)
        if int8:
            params = quantize_params(params)
        on, off = on_and_off(lambda: np.asarray(_prefill_and_decode(cfg, params, tokens[:1], start[:1])[0]))
        check(f"{name}{' int8' if int8 else ''} decode logits, SwiGLU in the reduction vs after it "
              "(largest difference)", float(np.abs(on - off).max()), 0)
        ids = [np.asarray(tokens[0, :40]).tolist()]
        run = lambda: np.asarray(jaxllm.generate(params, ids, max_new_tokens=24, eos_token_ids=[]).tokens)
        on, off = on_and_off(run)
        check(f"{name}{' int8' if int8 else ''} generate, a token differs (1 = yes)",
              float(not (on == off).all()), 0)


def generate_loop():
    """generate's on-device loop (one CUDA graph, conditional nodes included) stops each row at its
    own stop id: the tokens before it as in a run without stop ids, the length, padding after."""
    cfg = PRESETS["smollm2-135m"]
    params = random_params(cfg, 0, jnp.bfloat16)
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (20, 33, 7)]
    free = np.asarray(jaxllm.generate(params, ids, max_new_tokens=40, eos_token_ids=[]).tokens)
    first = lambda row, at: next((int(t) for n, t in enumerate(row) if n >= at and t not in row[:n]), -1)
    stops = [first(free[0], 5), first(free[1], 15)]  # ids that first come late in a row
    out = jaxllm.generate(params, ids, max_new_tokens=40, eos_token_ids=stops)
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    for b in range(len(ids)):
        hits = [n for n in range(40) if free[b, n] in stops]
        want = hits[0] + 1 if hits else 40
        n = int(lengths[b])
        ok = n == want and (tokens[b, :n] == free[b, :n]).all() and (tokens[b, n:] == cfg.pad_id).all()
        check(f"generate row {b} stops at its stop id (length {n}, wanted {want}; 1 = wrong)",
              float(not ok), 0)

    def generated():
        """The batch's tokens, then its first row's alone: `project`'s kernels take batch-1 steps
        only, so the 3-row batch alone would not run them."""
        run = lambda ids: np.asarray(jaxllm.generate(params, ids, max_new_tokens=40, eos_token_ids=[]).tokens)
        return np.concatenate([run(ids), run(ids[:1])])

    unchanged = generated()

    def tokens_without(switch: str, off, **more):
        """generate's tokens with kernels.`switch` set to `off` (and any `more` switches set so)."""
        return _with_switches({switch: off, **more}, generated)

    # Our kernels let the next one launch early (kernels.PDL_TRIGGER); a kernel that then read its
    # input before the one ahead had written it would change the tokens.
    check("generate with kernels signalling their dependents early, a token differs (1 = yes)",
          float(not (tokens_without("PDL_TRIGGER", False) == unchanged).all()), 0)
    # The projections' kernels ask L2 for the next projection's weights (kernels.prefetched): a
    # hint, so the tokens must not change without it.
    check("generate with the projections prefetching weights into L2, a token differs (1 = yes)",
          float(not (tokens_without("PREFETCH_MAX_BYTES", 0) == unchanged).all()), 0)
    # SmolLM2's layers load their weights before their input (kernels.weights_first): the same
    # sums, so the tokens must not change without it.
    check("generate with the projections loading weights first, a token differs (1 = yes)",
          float(not (tokens_without("WEIGHTS_FIRST", False) == unchanged).all()), 0)
    # Float matrices' kernels make the norm's sum of squares after the products
    # (kernels.SQUARES_LAST), as weights-first ones always do: without both, x is loaded first and
    # the squares made before the weights' load; the same sums, so the same tokens.
    check("generate with the norm's squares made before the products, a token differs (1 = yes)",
          float(not (tokens_without("SQUARES_LAST", False, WEIGHTS_FIRST=False)
                     == unchanged).all()), 0)
    # SmolLM2's layers are weights-first, so they ask L2 by bulk copies; a layer that is not asks
    # a line at a time (kernels.PREFETCH_LINES): Qwen3-0.6B's o in bf16, its qkv, o and down in
    # int8. A hint too: the same tokens with the bulk copy instead.
    qwen = dataclasses.replace(PRESETS["qwen3-0.6b"], num_layers=4)
    qwen_ids = [rng.integers(0, qwen.vocab_size, 40).tolist()]
    for quant in ("none", "int8"):
        q_params = random_params(qwen, 0, jnp.bfloat16, quant=quant)
        q_run = lambda: np.asarray(jaxllm.generate(q_params, qwen_ids, max_new_tokens=32,
                                                   eos_token_ids=[]).tokens)
        # Qwen3-0.6B's gate/up, from HBM, also loads twice the rows a program (kernels.GATE_UP_WIDE):
        # each output a sum over the same chunk, so its tokens should be those of the rows halved.
        # Both switches on, as they stand, then each off in turn.
        stand = {"PREFETCH_LINES": True, "GATE_UP_WIDE": True}
        on = _with_switches(stand, q_run)
        off = lambda switch: _with_switches({**stand, switch: False}, q_run)
        check(f"generate (Qwen3-0.6B widths, {quant}) with L2 asked by lines, a token differs from "
              "the bulk copy's (1 = yes)", float(not (on == off("PREFETCH_LINES")).all()), 0)
        check(f"generate (Qwen3-0.6B widths, {quant}) with gate/up's wider programs, a token "
              "differs from the halved rows' (1 = yes)", float(not (on == off("GATE_UP_WIDE")).all()), 0)


def sharded():
    """On 2 GPUs or more: 4-layer models of real widths split over two of them (tensor parallel,
    the decode kernel inside shard_map on each device's KV heads) against the same weights on
    one GPU: a ragged prefill and 8 decode steps, logits."""
    if jax.device_count() < 2:
        print("skip sharded: it needs 2 GPUs, this machine has 1", flush=True)
        return
    from jaxllm.model import sharding
    from jaxllm.model.params import init_params
    step = jax.jit(model.step, static_argnames="fresh")
    for name in ["qwen3-0.6b", "llama3.2-1b"]:
        cfg = dataclasses.replace(PRESETS[name], num_layers=4)
        tokens = jax.random.randint(jax.random.key(2), (3, 256), 0, cfg.vocab_size)
        start = jnp.asarray([0, 100, 255], jnp.int32)
        split = sharding.init_sharded(cfg, jax.random.key(3), sharding.make_mesh(2), jnp.bfloat16)
        whole = init_params(cfg, jax.random.key(3), jnp.bfloat16)  # the same values, on one GPU
        outs = []
        for params in (split, whole):
            logits, cache = step(params, tokens, init_cache(cfg, 3, 320, params.dtype, start), fresh=True)
            steps = [logits]
            for t in range(8):
                logits, cache = step(params, tokens[:, t:t + 1], cache)
                steps.append(logits)
            outs.append(jnp.stack(steps, 1))
        check(f"{name} on 2 GPUs (tensor parallel) vs 1, prefill and 8 steps' logits", rel(*outs), 3e-2)


if __name__ == "__main__":
    if jax.default_backend() != "gpu":
        print("gpu_check: no GPU here; these paths run only on one", file=sys.stderr)
        sys.exit(2)
    print(jax.__version__, jax.devices()[0].device_kind, flush=True)
    sections = {f.__name__: f for f in (decode_project, rows_project, decode_attention, add_norm,
                                          attention, fresh_prefill, generate_loop, moe, route,
                                          swiglu, sharded)}
    for name in sys.argv[1:] or sections:  # by default all; or the named ones
        sections[name]()
    print(f"gpu_check: {len(failures)} failed" + (": " + ", ".join(failures) if failures else ""))
    sys.exit(1 if failures else 0)
