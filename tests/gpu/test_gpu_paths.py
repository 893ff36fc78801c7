"""The GPU-only code paths checked on a GPU, where CI (CPU) cannot: `pytest -m gpu` on one.

- `layers.causal_attention` through cuDNN against float32, with and without a sliding window;
- a prefill into an empty cache (rotated rows, cuDNN) against the cache-reading prefill, on a
  ragged batch at real model widths: logits, the next decode step, the cache it wrote;
- the Pallas decode-attention kernel against float32 XLA attention, and decode steps through it
  against XLA's masked form at real model widths; its few-token form (`verify_attention`) the
  same, and verify steps through it (and rows_project) against XLA's prefill forms;
- `kernels.project` (batch-1 norm, matrix-vector product and epilogue in one kernel; bf16 and int8;
  on each backend, Triton and Mosaic GPU) and `kernels.rows_project` (decode steps of 8-32 rows)
  against float32 XLA, and decode through them;
- `kernels.add_norm` against float32, and a prefill through it against XLA, on each backend
  (Triton, Mosaic GPU);
- Gemma's switches of those kernels (score scale, soft cap, (1 + w) q/k norms in both attention
  kernels at heads of 256; GeGLU's tanh GELU in gate/up's epilogues; add_norm's (1 + w) norms and
  post-norm), and Gemma 2 and 3 decode and verify steps through every kernel against XLA's;
- every MoE path against the dense path in float32; `kernels.route` against XLA's routing; the
  gathered experts' SwiGLU in one variadic reduction against a reduction and a multiply after it;
- generate's on-device loop stopping each row at its own stop id, and its tokens unchanged by the
  kernels' hints (PDL signals, L2 prefetch, load order);
- every kernel family's compile probe (`kernels.probe`) passes;
- on 2 GPUs or more, models split over two of them (tensor parallel) against one GPU.
Bounds are a few times the bf16 errors seen on an H200: attention 3.5e-3, prefill logits 1.5e-2,
MoE 7.2e-3. Gemma's whole steps are held to XLA's own distance from float32 (`_as_close_as_xla`).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxllm
from jaxllm import kernels
from jaxllm.kernels import tuning as tuning_module
from jaxllm.kernels.rows_project import supports as rows_supports
from jaxllm.layers import dense as L
from jaxllm.layers import moe as moe_layers
from jaxllm.model import plan
from jaxllm.layers.quant import quantize
from jaxllm.model import transformer as model
from jaxllm.model.cache import init_cache, rollback
from jaxllm.model.params import quantize_params
from jaxllm.tools.presets import PRESETS, random_params

pytestmark = [pytest.mark.gpu, pytest.mark.slow]  # slow too: `-m "not slow"` replaces addopts' -m

bf16, f32 = jnp.bfloat16, jnp.float32


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / (np.abs(b).max() + 1e-12))


def _ragged_batch(name: str, seed: int, **overrides):
    """A 4-layer model of a preset's widths (random weights; its config changed in `overrides`)
    and 3 prompts of 256 slots that start at 0, 100 and 255: (config, params, tokens, start)."""
    cfg = dataclasses.replace(PRESETS[name], num_layers=4, **overrides)
    tokens = jax.random.randint(jax.random.key(seed), (3, 256), 0, cfg.vocab_size)
    return cfg, random_params(cfg), tokens, jnp.asarray([0, 100, 255], jnp.int32)


def _with_switches(switches: dict, run, module=kernels):
    """run() with the module flags of `module` (`kernels` by default) set as `switches` says, jit
    caches cleared around it, the flags restored after."""
    if module is kernels:  # the knobs of the process's KernelTuning, by their JAXLLM names
        module, switches = tuning_module, {"TUNING": dataclasses.replace(
            tuning_module.TUNING, **{name.lower(): value for name, value in switches.items()})}
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


def _generate(params, ids, n):
    return np.asarray(jaxllm.generate(params, ids, max_new_tokens=n, eos_token_ids=[]).tokens)


# -- attention ------------------------------------------------------------------------------------

@pytest.mark.parametrize("T, window, H", [(16, None, 64), (300, None, 128), (2048, None, 128),
                                          (300, 64, 128), (1024, 4, 64)])
def test_cudnn_attention(T, window, H):
    attend = jax.jit(L.causal_attention, static_argnums=3)
    keys = jax.random.split(jax.random.key(T), 3)
    q = jax.random.normal(keys[0], (2, T, 8, H), bf16)
    k = jax.random.normal(keys[1], (2, T, 2, H), bf16)
    v = jax.random.normal(keys[2], (2, T, 2, H), bf16)
    assert L.uses_cudnn_attention(q.dtype, H)
    want = attend(q.astype(f32), k.astype(f32), v.astype(f32), window)
    assert rel(attend(q, k, v, window), want) <= 1e-2


@pytest.mark.parametrize("name", ["qwen3-0.6b", "llama3.2-1b"])
def test_fresh_prefill_matches_cache_reading(name):
    step = jax.jit(model.step, static_argnames="fresh")
    cfg, params, tokens, start = _ragged_batch(name, seed=1)
    outs = {}
    for fresh in (True, False):
        logits, cache = step(params, tokens, init_cache(cfg, 3, 320, params.dtype, start), fresh=fresh)
        after, cache = step(params, jnp.argmax(logits, -1)[:, None].astype(jnp.int32), cache)
        outs[fresh] = logits, after, cache.k[2][1, :, 100:256]
    for what, i, bound in [("logits", 0, 3e-2), ("next step", 1, 3e-2), ("cache k", 2, 3e-2)]:
        assert rel(outs[True][i], outs[False][i]) <= bound, what
    assert bool(jnp.all(jnp.argmax(outs[True][0], -1) == jnp.argmax(outs[False][0], -1))), \
        "a greedy token differs"


# -- decode attention -----------------------------------------------------------------------------

def _decode_attention_reference(qkv, k_cache, v_cache, end, start, inv_freq, window, q_norm, k_norm,
                                scale=None, softcap=None, norm_offset=0.0):
    B, K, J, H = qkv.shape
    G, positions = J - 2, (end - start)[:, None]
    q, k, v = qkv[:, :, :G].reshape(B, 1, K * G, H), qkv[:, None, :, G], qkv[:, None, :, G + 1]
    if q_norm is not None:
        q, k = L.rms_norm(q, q_norm, 1e-6, norm_offset), L.rms_norm(k, k_norm, 1e-6, norm_offset)
    q, k = L.rope(q, positions, inv_freq), L.rope(k, positions, inv_freq)
    k_cache, v_cache = (c.at[jnp.arange(B), :, end].set(x[:, 0]) for c, x in ((k_cache, k), (v_cache, v)))
    mask = L.visible_mask(end[:, None], start, k_cache.shape[2], window)
    return L.attention(q.reshape(B, 1, K, G, H), k_cache, v_cache, mask, scale=scale,
                       softcap=softcap)[:, 0], k_cache


@pytest.mark.parametrize("B, K, G, H, S, furthest, window, norm", [
    (1, 8, 4, 128, 384, 300, None, False), (1, 3, 3, 64, 384, 200, None, False),
    (4, 8, 4, 128, 8448, 8000, None, False), (2, 8, 2, 128, 8448, 500, None, True),
    (32, 8, 4, 128, 384, 383, 100, False), (32, 8, 4, 128, 2304, 2100, None, False)])
def test_decode_attention_kernel(B, K, G, H, S, furthest, window, norm):
    keys = jax.random.split(jax.random.key(S + furthest), 5)
    qkv = jax.random.normal(keys[0], (B, K, G + 2, H), bf16)
    caches = [jax.random.normal(k, (B, K, S, H), bf16) for k in keys[1:3]]
    norms = [1 + 0.1 * jax.random.normal(k, (H,), bf16) for k in keys[3:]] if norm else [None, None]
    start = jnp.arange(B, dtype=jnp.int32) * 7 % 50
    end = furthest - jnp.arange(B, dtype=jnp.int32) * 5 % 30  # ragged rows, the first at `furthest`
    inv_freq = jnp.asarray(1.0 / 500000 ** (np.arange(0, H, 2) / H), f32)
    angles = jnp.arange(S, dtype=f32)[:, None] * inv_freq  # by position, as generate's
    up = lambda xs: [None if x is None else x.astype(f32) for x in xs]
    want, want_k = jax.jit(_decode_attention_reference, static_argnums=6)(
        *up([qkv, *caches]), end, start, inv_freq, window, *up(norms))
    rotation = jnp.stack([jnp.cos(angles), jnp.sin(angles)], axis=1)
    got, got_k, _ = kernels.decode_attention(qkv, *caches, end, start, rotation,
                                             window=window, q_norm_H=norms[0],
                                             k_norm_H=norms[1], eps=1e-6)
    assert rel(got, want) <= 1e-2
    assert rel(got_k, want_k) <= 1e-2, "cache k"


def test_rotation_table_made_once_matches_each_steps():
    """A loop's table made once (generate, stream) against each step's own (decode_step alone)."""
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
    assert rel(runs[1], runs[0]) <= 0


@pytest.mark.parametrize("name", ["qwen3-0.6b", "llama3.2-1b"])
def test_decode_via_attention_kernel_matches_xla(name):
    outs = _decode_both_ways(*_ragged_batch(name, seed=2), ["DECODE_ATTENTION"])
    assert rel(outs["auto"][0], outs["xla"][0]) <= 3e-2, "logits"
    assert rel(outs["auto"][1], outs["xla"][1]) <= 3e-2, "cache k"


# -- verify steps (2-9 new tokens a row on a warm cache) -------------------------------------------

def _verify_attention_reference(qkv, k_cache, v_cache, end, start, inv_freq, window, q_norm, k_norm,
                                scale=None, softcap=None, norm_offset=0.0):
    B, T, K, J, H = qkv.shape
    G = J - 2
    slots = end[:, None] + jnp.arange(T)[None, :]
    positions = jnp.maximum(slots - start[:, None], 0)
    q, k, v = qkv[:, :, :, :G].reshape(B, T, K * G, H), qkv[:, :, :, G], qkv[:, :, :, G + 1]
    if q_norm is not None:
        q, k = L.rms_norm(q, q_norm, 1e-6, norm_offset), L.rms_norm(k, k_norm, 1e-6, norm_offset)
    q, k = L.rope(q, positions, inv_freq), L.rope(k, positions, inv_freq)
    write = jax.vmap(lambda c, x, e: jax.lax.dynamic_update_slice(c, x.transpose(1, 0, 2), (0, e, 0)))
    k_cache, v_cache = write(k_cache, k, end), write(v_cache, v, end)
    mask = L.visible_mask(slots, start, k_cache.shape[2], window)
    return L.attention(q.reshape(B, T, K, G, H), k_cache, v_cache, mask, scale=scale,
                       softcap=softcap), k_cache


@pytest.mark.parametrize("B, T, K, G, H, S, furthest, window, norm", [
    (1, 5, 8, 4, 128, 384, 300, None, False),  # the 8B shape at batch 1
    (1, 9, 3, 3, 64, 448, 200, None, False),  # SmolLM2's heads
    (1, 9, 8, 8, 128, 384, 375, None, False),  # 128 query rows, to the cache's last slot
    (4, 8, 8, 4, 128, 8448, 8000, None, False), (2, 4, 8, 2, 128, 8448, 500, None, True),
    (8, 4, 8, 4, 128, 384, 380, 100, False), (32, 2, 8, 4, 128, 2304, 2100, None, False)])
def test_verify_attention_kernel(B, T, K, G, H, S, furthest, window, norm):
    keys = jax.random.split(jax.random.key(S + furthest + T), 5)
    qkv = jax.random.normal(keys[0], (B, T, K, G + 2, H), bf16)
    caches = [jax.random.normal(k, (B, K, S, H), bf16) for k in keys[1:3]]
    norms = [1 + 0.1 * jax.random.normal(k, (H,), bf16) for k in keys[3:]] if norm else [None, None]
    start = jnp.arange(B, dtype=jnp.int32) * 7 % 50
    end = furthest - jnp.arange(B, dtype=jnp.int32) * 5 % 30  # ragged rows, the first at `furthest`
    inv_freq = jnp.asarray(1.0 / 500000 ** (np.arange(0, H, 2) / H), f32)
    angles = jnp.arange(S, dtype=f32)[:, None] * inv_freq
    up = lambda xs: [None if x is None else x.astype(f32) for x in xs]
    want, want_k = jax.jit(_verify_attention_reference, static_argnums=6)(
        *up([qkv, *caches]), end, start, inv_freq, window, *up(norms))
    rotation = jnp.stack([jnp.cos(angles), jnp.sin(angles)], axis=1)
    assert plan.decode_attention_mode(bf16, H, H, False, S, tokens=T, q_per_kv=G) == "gpu"
    got, got_k, _ = kernels.verify_attention(qkv, *caches, end, start, rotation, window=window,
                                             q_norm_H=norms[0], k_norm_H=norms[1], eps=1e-6)
    assert rel(got, want) <= 1e-2
    assert rel(got_k, want_k) <= 1e-2, "cache k"


@pytest.mark.parametrize("name, B, T, rows_min, family", [
    ("llama3-8b", 1, 5, 8, None),  # 5 rows: XLA's matrices, the attention kernel
    ("llama3-8b", 1, 5, 2, "rows"),  # the same through rows_project (VERIFY_ROWS_MIN=2)
    ("llama3-8b", 3, 5, 8, "rows"), ("smollm2-135m", 1, 8, 8, None),
    ("qwen3-0.6b", 3, 9, 8, None), ("llama3.2-1b", 4, 8, 8, "rows")])
def test_verify_step_via_kernels_matches_xla(name, B, T, rows_min, family):
    """A verify step (every position's logits) of ragged rows through the kernels the plan picks,
    against XLA's prefill forms (VERIFY_TOKENS=0): logits and the cache it wrote."""
    cfg, params, tokens, start = _ragged_batch(name, seed=6)
    tokens, start = jnp.tile(tokens, (2, 1))[:B], jnp.tile(start, 2)[:B]
    step = jax.jit(model.step, static_argnames=("fresh", "all_logits"))

    def run(kernels_on: bool):
        if kernels_on:
            p = plan.step_plan(params, B, T, cache_length=320)
            assert p.attention == "gpu" and p.layers[0].projection.family == family, name
        cache = init_cache(cfg, B, 320, params.dtype, start)
        _, cache = step(params, tokens, cache, fresh=True)
        cache = rollback(cache, jnp.arange(B) % 3)  # ends 256, 255, 254
        logits, cache = step(params, tokens[:, 40:40 + T], cache, all_logits=True)
        return logits, cache.k[3][:, :, 250:264]

    got = _with_switches({"VERIFY_ROWS_MIN": rows_min}, lambda: run(True))
    want = _with_switches({"VERIFY_ROWS_MIN": rows_min, "VERIFY_TOKENS": 0}, lambda: run(False))
    assert got[0].shape == (B, T, cfg.vocab_size)
    assert rel(got[0], want[0]) <= 3e-2, "logits"
    assert rel(got[1], want[1]) <= 3e-2, "cache k"


# -- project (batch-1 decode) ---------------------------------------------------------------------

def _upcast(a):
    return a.astype(f32) if a.dtype == bf16 else a


def _project_cases(D, N, F):
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
    return cases, dict(keys=keys, w_gate_up=w_gate_up, w_down=w_down, g=g, x=x)


# Qwen3-0.6B's and SmolLM2's widths, and the 8B shape's, whose matrices take the kernel in int8
# only (the down projection's 14336 channels in whole chunks of 2048).
PROJECT_WIDTHS = [(1024, 4096, 3072), (576, 960, 1536), (4096, 6144, 14336)]
PROJECT_CASES = [(widths, i) for widths in PROJECT_WIDTHS for i in range(3 if widths[0] == 4096 else 6)]


@pytest.mark.parametrize("backend", tuning_module.BACKENDS)
@pytest.mark.parametrize("widths, case", PROJECT_CASES)
def test_project_kernel(widths, case, backend):
    cases, _ = _project_cases(*widths)
    name, a, m, kw = cases[case]
    tuning = dataclasses.replace(kernels.current(), project_backend=backend)  # int8: Triton's either way
    got = kernels.project(a, m, mode="gpu", tuning=tuning, **kw)
    arrays = {k: v for k, v in kw.items() if isinstance(v, jax.Array)}
    static = {k: v for k, v in kw.items() if k not in arrays}
    m32 = m.replace(dtype=f32) if hasattr(m, "q") else m  # int8 values, float32 scale
    want = kernels.project(_upcast(a), jax.tree.map(_upcast, m32), mode=None,
                           **jax.tree.map(_upcast, arrays), **static)
    assert rel(got, want) <= 2e-2, f"decode project D={widths[0]} {name}"


def _project_8b():
    _, v = _project_cases(4096, 6144, 14336)
    w_int8 = quantize(v["w_gate_up"])
    _, row = kernels.add_norm(v["x"], jnp.zeros_like(v["x"]), v["g"], 1e-5, mode="gpu", digits=True)
    return v, w_int8, row


def test_project_int8_gate_up_from_add_norm_digits():
    """gate/up from add_norm's int8 digits, on tensor cores (INT8_DIGITS)."""
    v, w_int8, row = _project_8b()
    got = kernels.project(row, w_int8, swiglu=True, mode="gpu")
    want = kernels.project(_upcast(v["x"]), w_int8.replace(dtype=f32), norm_C=_upcast(v["g"]),
                           eps=1e-5, swiglu=True)
    assert isinstance(row, kernels.DigitRow) and plan.project_digits(w_int8, "gpu", True), \
        "NOT TAKEN"
    assert rel(got, want) <= 2e-2


def test_project_int8_lm_head_from_add_norm_digits():
    """An int8 lm_head past KERNEL_MAX_INT8_WEIGHTS from the final norm's digits."""
    v, _, row = _project_8b()
    head = quantize(jax.random.normal(v["keys"][0], (40960, 4096), bf16) * 4096 ** -0.5)
    got = kernels.project(row, head, mode="gpu", out_dtype=f32)
    want = kernels.project(_upcast(v["x"]), head.replace(dtype=f32), norm_C=_upcast(v["g"]),
                           eps=1e-5, out_dtype=f32)
    assert plan.project_digits(head, "gpu") or not kernels.current().int8_head_digits, "NOT TAKEN"
    assert rel(got, want) <= 2e-2


def test_project_int8_down_from_gate_up_digits():
    """down from the digits that gate/up's kernel writes of its output (INT8_DOWN_DIGITS); gate/up's
    output the same bits as without them."""
    v, w_int8, row = _project_8b()
    w_down_int8 = quantize(v["w_down"])
    bounds = kernels.down_bounds([w_int8])
    act = kernels.project(row, w_int8, swiglu=True, mode="gpu", down_digits_of=(bounds, 0))
    assert isinstance(act, kernels.DigitRow) and plan.down_digits(w_down_int8, "gpu"), "NOT TAKEN"
    got = kernels.project(act, w_down_int8, mode="gpu")
    plain = kernels.project(row, w_int8, swiglu=True, mode="gpu")
    assert np.array_equal(np.asarray(act.x), np.asarray(plain)), "gate/up's output not the same bits"
    want = kernels.project(_upcast(act.x), w_down_int8.replace(dtype=f32))
    assert rel(got, want) <= 2e-2


@pytest.mark.parametrize("K, G, H, D", [(8, 2, 128, 1024), (3, 3, 64, 576)])
def test_project_o_from_attention_splits(K, G, H, D):
    keys = jax.random.split(jax.random.key(K * H), 5)
    acc = jax.random.normal(keys[0], (1, 6, K, G, H), f32)
    m, l = jax.random.normal(keys[1], (1, 6, K, G), f32), 1 + jax.random.uniform(keys[2], (1, 6, K, G))
    wo = jax.random.normal(keys[3], (D, K * G * H), bf16) * (K * G * H) ** -0.5
    x = jax.random.normal(keys[4], (1, D), bf16)
    got = kernels.project(kernels.SplitHeads(acc, m, l, dtype=bf16), wo, residual_MN=x, mode="gpu")
    want = kernels.project(kernels.SplitHeads(acc, m, l, dtype=f32), wo.astype(f32),
                           residual_MN=x.astype(f32))
    assert rel(got, want) <= 2e-2


# Llama-3.2-1B's FFN and the 8B shape's matrices are too large for project's kernel: their norms go
# through add_norm's. In int8 the 8B shape's matrices take project's kernel, their norms still
# add_norm's, but gate/up and the lm_head take add_norm's digits on tensor cores.
@pytest.mark.parametrize("name, int8", [("qwen3-0.6b", False), ("llama3.2-1b", False),
                                        ("llama3-8b", False), ("llama3-8b", True)])
@pytest.mark.parametrize("backend", tuning_module.BACKENDS)
def test_batch1_decode_via_both_kernels_matches_xla(name, int8, backend):
    cfg, params, tokens, start = _ragged_batch(name, seed=3)
    params = quantize_params(params) if int8 else params
    outs = _with_switches({"PROJECT_BACKEND": backend}, lambda: _decode_both_ways(
        cfg, params, tokens[1:2], start[1:2], ["DECODE_ATTENTION", "DECODE_PROJECT"]))
    assert rel(outs["auto"][0], outs["xla"][0]) <= 3e-2


# -- rows_project (decode steps of 8-32 rows) -----------------------------------------------------

@pytest.mark.parametrize("D, N, F", [(4096, 6144, 14336), (1024, 4096, 3072)])
@pytest.mark.parametrize("M", [kernels.current().rows_max, 5])
@pytest.mark.parametrize("case", ["norm + qkv + bias", "o + residual", "norm + gate/up + swiglu",
                                  "down + residual"])
def test_rows_project_kernel(D, N, F, M, case):
    keys = jax.random.split(jax.random.key(D), 8)
    w = jax.random.normal(keys[0], (N, D), bf16) * D ** -0.5
    wo = jax.random.normal(keys[1], (D, N), bf16) * N ** -0.5
    w_gate_up = jax.random.normal(keys[2], (2, F, D), bf16) * D ** -0.5
    w_down = jax.random.normal(keys[3], (D, F), bf16) * F ** -0.5
    g = 1 + 0.1 * jax.random.normal(keys[4], (D,), bf16)
    b = jax.random.normal(keys[5], (N,), bf16)
    x = jax.random.normal(keys[6], (M, D), bf16)
    heads = jax.random.normal(keys[7], (M, N), bf16)
    act = jax.random.normal(keys[7], (M, F), bf16)
    a, m, kw = {"norm + qkv + bias": (x, w, dict(norm_C=g, bias_N=b)),
                "o + residual": (heads, wo, dict(residual_MN=x)),
                "norm + gate/up + swiglu": (x, w_gate_up, dict(norm_C=g, swiglu=True)),
                "down + residual": (act, w_down, dict(residual_MN=x))}[case]
    assert rows_supports(m, kw.get("swiglu", False)), "NOT TAKEN"
    got = kernels.rows_project(a, m, mode="gpu", eps=1e-5, **kw)
    up = lambda a: a.astype(f32)
    want = kernels.rows_project(up(a), up(m), eps=1e-5,
                                **{k: up(v) if isinstance(v, jax.Array) else v for k, v in kw.items()})
    assert rel(got, want) <= 2e-2


@pytest.mark.parametrize("name, rows", [("qwen3-0.6b", 32), ("llama3.2-1b", 32), ("llama3-8b", 32),
                                        ("llama3-8b", 16)])
def test_rows_decode_via_rows_project_matches_xla(name, rows):
    """Decode steps of 32 rows (and 16, the 8B shape's, whose kernels give no PDL signal) through
    every kernel, against XLA's: the ragged batch's 3 prompts over and over."""
    cfg, params, tokens, start = _ragged_batch(name, seed=5)
    tokens, start = jnp.tile(tokens, (11, 1))[:rows], jnp.tile(start, 11)[:rows]
    assert plan.step_plan(params, rows, 1).layers[0].projection == plan.Projection("rows", "gpu"), name
    outs = _decode_both_ways(cfg, params, tokens, start, ["DECODE_ATTENTION", "ROWS_PROJECT"])
    assert rel(outs["auto"][0], outs["xla"][0]) <= 3e-2


def test_rows_generate_unchanged_by_early_launch():
    """Its kernels let the next one launch early (kernels.PDL_TRIGGER): a kernel that read its input
    before the one ahead had written it would change the tokens of a 32-row generate."""
    cfg = PRESETS["smollm2-135m"]
    params = random_params(cfg, 0, jnp.bfloat16)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (32, 20))
    assert plan.step_plan(params, 32, 1).layers[0].projection == plan.Projection("rows", "gpu")
    run = lambda: _generate(params, ids, 40)
    unsignalled = _with_switches({"PDL_TRIGGER": False}, run)
    assert (run() == unsignalled).all()


# -- add_norm -------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", tuning_module.BACKENDS)
@pytest.mark.parametrize("M, C", [(2048, 4096), (32, 4096), (3, 576), (5, 896)])  # long, short; odd
def test_add_norm_kernel(M, C, backend):
    keys = jax.random.split(jax.random.key(M + C), 3)
    x, delta = (jax.random.normal(k, (M, C), bf16) for k in keys[:2])
    g = 1 + 0.1 * jax.random.normal(keys[2], (C,), bf16)
    tuning = dataclasses.replace(kernels.current(), add_norm_backend=backend)
    got = kernels.add_norm(x, delta, g, 1e-5, mode="gpu", tuning=tuning)
    want = kernels.add_norm(x.astype(f32), delta.astype(f32), g.astype(f32), 1e-5)
    assert rel(got[0], want[0]) <= 1e-2, "sum"
    assert rel(got[1], want[1]) <= 2e-2, "normed"


@pytest.mark.parametrize("backend", tuning_module.BACKENDS)
@pytest.mark.parametrize("name", ["qwen3-0.6b", "llama3.2-1b"])
def test_prefill_and_decode_via_add_norm_matches_xla(name, backend):
    outs = _with_switches({"ADD_NORM_BACKEND": backend},
                          lambda: _decode_both_ways(*_ragged_batch(name, seed=4), ["ADD_NORM"]))
    assert rel(outs["auto"][0], outs["xla"][0]) <= 3e-2


# -- Gemma's switches of the kernels, and Gemma's steps through them ------------------------------

# gemma2-2b's heads (K 4, G 2, scores scaled by 256^-1/2 and capped, at 5 rather than 50 so that
# the cap bites on random scores) and gemma3-1b's (K 1, G 4, (1 + w) q/k norms), both of 256,
# under a window.
GEMMA_ATTENTION = [(4, 2, 64, False, dict(scale=256 ** -0.5, softcap=5.0)),
                   (1, 4, 64, True, dict(scale=256 ** -0.5, norm_offset=1.0))]


@pytest.mark.parametrize("K, G, window, norm, switches", GEMMA_ATTENTION)
@pytest.mark.parametrize("B, T, S, furthest", [(1, 1, 640, 600), (32, 1, 2304, 2100), (1, 5, 640, 600),
                                               (8, 4, 8448, 8000)])
def test_attention_kernels_with_gemmas_switches(K, G, window, norm, switches, B, T, S, furthest):
    H = 256
    keys = jax.random.split(jax.random.key(S + furthest + T + K), 5)
    shape = (B, K, G + 2, H) if T == 1 else (B, T, K, G + 2, H)
    qkv = jax.random.normal(keys[0], shape, bf16)
    caches = [jax.random.normal(k, (B, K, S, H), bf16) for k in keys[1:3]]
    norms = [0.1 * jax.random.normal(k, (H,), bf16) for k in keys[3:]] if norm else [None, None]
    start = jnp.arange(B, dtype=jnp.int32) * 7 % 50
    end = furthest - jnp.arange(B, dtype=jnp.int32) * 5 % 30
    inv_freq = jnp.asarray(1.0 / 10000 ** (np.arange(0, H, 2) / H), f32)
    angles = jnp.arange(S, dtype=f32)[:, None] * inv_freq
    up = lambda xs: [None if x is None else x.astype(f32) for x in xs]
    reference = _decode_attention_reference if T == 1 else _verify_attention_reference
    want, want_k = jax.jit(functools.partial(reference, **switches), static_argnums=6)(
        *up([qkv, *caches]), end, start, inv_freq, window, *up(norms))
    rotation = jnp.stack([jnp.cos(angles), jnp.sin(angles)], axis=1)
    assert plan.decode_attention_mode(bf16, H, H, False, S, tokens=T, q_per_kv=G) == "gpu"
    call = kernels.decode_attention if T == 1 else kernels.verify_attention
    got, got_k, _ = call(qkv, *caches, end, start, rotation, window=window, q_norm_H=norms[0],
                         k_norm_H=norms[1], eps=1e-6, **switches)
    assert rel(got, want) <= 1e-2
    assert rel(got_k, want_k) <= 1e-2, "cache k"


@pytest.mark.parametrize("D, F", [(1152, 6912), (2304, 9216)])  # gemma3-1b's, gemma2-2b's
@pytest.mark.parametrize("M", [1, 32])
def test_gate_up_kernels_with_gelu_tanh(D, F, M):
    """GeGLU's gate/up in `project` (one row; int8 too where the float matrix is too large for its
    kernel) and `rows_project` (32 rows), against float32 XLA."""
    keys = jax.random.split(jax.random.key(D + M), 3)
    w = jax.random.normal(keys[0], (2, F, D), bf16) * D ** -0.5
    x = jax.random.normal(keys[1], (M, D), bf16)
    weights = [w, quantize(w)] if M == 1 else [w]
    for m in weights:
        call = kernels.project if M == 1 else kernels.rows_project
        got = call(x, m, swiglu=True, activation="gelu_tanh", mode="gpu")
        ref_w = m.astype(f32) if m is w else m
        want = kernels.project(x.astype(f32), ref_w, swiglu=True, activation="gelu_tanh")
        assert rel(got, want) <= 2e-2


@pytest.mark.parametrize("backend", tuning_module.BACKENDS)
@pytest.mark.parametrize("M, C", [(1, 1152), (32, 2304), (3, 576)])
def test_add_norm_kernel_with_gemmas_norms(M, C, backend):
    keys = jax.random.split(jax.random.key(M + C), 4)
    x, delta = (jax.random.normal(k, (M, C), bf16) for k in keys[:2])
    g, post = (0.1 * jax.random.normal(k, (C,), bf16) for k in keys[2:])
    tuning = dataclasses.replace(kernels.current(), add_norm_backend=backend)
    got = kernels.add_norm(x, delta, g, 1e-6, offset=1.0, delta_norm_C=post, mode="gpu", tuning=tuning)
    want = kernels.add_norm(x.astype(f32), delta.astype(f32), g.astype(f32), 1e-6, offset=1.0,
                            delta_norm_C=post.astype(f32))
    assert rel(got[0], want[0]) <= 1e-2, "sum"
    assert rel(got[1], want[1]) <= 2e-2, "normed"


GEMMA_STEPS = ["DECODE_ATTENTION", "DECODE_PROJECT", "ROWS_PROJECT", "ADD_NORM"]


def _float32_reference(params, run, switches):
    """run(params) with every weight in float32, XLA's matrix products at full precision."""
    wide = jax.tree.map(lambda x: x.astype(f32) if x.dtype == bf16 else x, params)
    with jax.default_matmul_precision("float32"):
        return _with_switches(switches, lambda: run(wide))


def _as_close_as_xla(got, xla, want):
    """Gemma's random bf16 models drift far from float32 on any path ((1 + w) norms, the sqrt(D)
    embedding scale): 4 layers of gemma3-1b's widths are 9% off in logits and 13% in the cache on
    XLA and the kernels alike (interpreted on a CPU). So the kernels' outputs are held to XLA's own
    distance from float32, not to XLA's outputs."""
    for what, g, x, w in zip(("logits", "cache k"), got, xla, want):
        assert rel(g, w) <= 1.25 * rel(x, w) + 1e-2, (what, rel(g, w), rel(x, w))


@pytest.mark.parametrize("name", ["gemma3-1b", "gemma2-2b"])
@pytest.mark.parametrize("rows", [1, 32])
def test_gemma_decode_via_kernels_matches_xla(name, rows):
    """Gemma's decode steps of one row and of 32 through every kernel the plan gives them, a
    window of 64 (so the 8 steps after 256 slots slide it), against XLA's forms."""
    cfg, params, tokens, start = _ragged_batch(name, seed=7, sliding_window=64)
    tokens, start = jnp.tile(tokens, (11, 1))[:rows], jnp.tile(start, 11)[:rows]
    paths = plan.describe(plan.step_plan(params, rows, 1, cache_length=320))
    assert paths["attention"] == paths["add_norm"] == "kernel", paths
    assert paths["qkv"] == paths["o"] == ("project" if rows == 1 else "rows"), paths
    outs = _decode_both_ways(cfg, params, tokens, start, GEMMA_STEPS)
    want = _float32_reference(params, lambda p: _prefill_and_decode(cfg, p, tokens, start),
                              dict.fromkeys(GEMMA_STEPS, "xla"))
    _as_close_as_xla(outs["auto"], outs["xla"], want)


@pytest.mark.parametrize("name, B, T", [("gemma3-1b", 1, 5), ("gemma2-2b", 3, 4)])
def test_gemma_verify_step_via_kernels_matches_xla(name, B, T):
    """A Gemma verify step through verify_attention (and, at 12 rows, rows_project, taken by
    matrices of any size here, and add_norm) against XLA's prefill forms: every position's logits,
    the cache it wrote."""
    cfg, params, tokens, start = _ragged_batch(name, seed=8, sliding_window=64)
    tokens, start = jnp.tile(tokens, (2, 1))[:B], jnp.tile(start, 2)[:B]
    step = jax.jit(model.step, static_argnames=("fresh", "all_logits"))

    def run(params=params):
        cache = init_cache(cfg, B, 320, params.dtype, start)
        _, cache = step(params, tokens, cache, fresh=True)
        cache = rollback(cache, jnp.arange(B) % 3)
        logits, cache = step(params, tokens[:, 40:40 + T], cache, all_logits=True)
        return logits, cache.k[3][:, :, 250:264]

    def planned():
        p = plan.step_plan(params, B, T, cache_length=320)
        assert p.attention == "gpu" and p.layers[0].projection.family == ("rows" if B > 1 else None)
        return run()

    got = _with_switches({"VERIFY_ROWS_MIN": 8, "ROWS_LARGE_WEIGHTS": 0}, planned)
    xla = _with_switches({"VERIFY_TOKENS": 0}, run)
    everything_xla = dict.fromkeys(GEMMA_STEPS, "xla") | {"VERIFY_TOKENS": 0}
    _as_close_as_xla(got, xla, _float32_reference(params, run, everything_xla))


def test_gemma3_rotation_tables_made_once_match_each_steps():
    """gemma3-1b's two ropes: the tables a loop makes once (a tuple, one a rope) against each
    step's own, through every kernel: the same logits, bit for bit."""
    cfg, params, tokens, start = _ragged_batch("gemma3-1b", seed=9, sliding_window=64)
    step = jax.jit(model.step, static_argnames="fresh")
    tables = model.rotation_table(cfg, 320)
    assert isinstance(tables, tuple) and len(tables) == 2
    runs = []
    for rotation in (None, tables):
        cache = init_cache(cfg, tokens.shape[0], 320, params.dtype, start)
        logits, cache = step(params, tokens, cache, fresh=True)
        steps = []
        for t in range(4):
            logits, cache = step(params, tokens[:, t:t + 1], cache, rotation=rotation)
            steps.append(logits)
        runs.append(jnp.stack(steps, 1))
    assert rel(runs[1], runs[0]) <= 0


# -- MoE ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("E, A, D, F", [(8, 2, 4096, 14336), (128, 8, 2048, 768)])
@pytest.mark.parametrize("M", [1, 8, 64, 700])
@pytest.mark.parametrize("path, grouped", [("gather", "auto"), ("dense", "auto"), ("ragged", "auto"),
                                           ("ragged", "xla")])
def test_moe_path_matches_dense_float32(E, A, D, F, M, path, grouped, monkeypatch):
    if path == "gather" and M > 64:
        pytest.skip("the gather path serves up to 64 tokens")
    keys = jax.random.split(jax.random.key(E), 4)
    router = jax.random.normal(keys[0], (E, D), bf16) * 0.05
    gate_up = jax.random.normal(keys[1], (E, 2, F, D), bf16) * 0.02
    down = jax.random.normal(keys[2], (E, D, F), bf16) * 0.02
    x = jax.random.normal(keys[3], (1, M, D), bf16)
    want = moe_layers.moe(x.astype(f32), *(w.astype(f32) for w in (router, gate_up, down)), A, True, path="dense")
    monkeypatch.setattr(moe_layers, "GROUPED_GEMM", grouped)
    got = jax.jit(lambda *w: moe_layers.moe(*w, A, True, path=path))(x, router, gate_up, down)
    assert rel(got, want) <= 2e-2


@pytest.mark.parametrize("E, A, norm", [(8, 2, True), (128, 8, True), (60, 4, False)])
@pytest.mark.parametrize("M", [1, 16, 2048])
def test_route_kernel_matches_xla(E, A, norm, M):
    """The same experts in the same order, the same weights to float32 rounding."""
    keys = jax.random.split(jax.random.key(E * M), 2)
    x = jax.random.normal(keys[0], (M, 2048), bf16).at[0].set(0)  # row 0: all tie
    router = jax.random.normal(keys[1], (E, 2048), bf16) * 0.05
    # The same bf16 logits into both (XLA may keep a fused product's excess precision).
    logits = jax.jit(moe_layers.router_logits)(x, router)
    want = jax.jit(moe_layers.pick_experts, static_argnums=(1, 2))(logits, A, norm)
    got = kernels.pick_experts(logits, A, norm)
    assert float(np.mean(np.asarray(got[0]) != np.asarray(want[0]))) == 0, "experts not as XLA's"
    assert rel(got[1], want[1]) <= 1e-5, "weights"


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b"])
def test_moe_models_routed_by_kernel_match_xla(name):
    """Not the same bits: the kernel takes the logits rounded to bf16 (as transformers' linear layer
    gives them), where XLA's fusion may keep its product's float32, so the bound is that of the
    other kernels' model-level checks; generate's tokens unchanged with the PDL signals off."""
    cfg, params, tokens, start = _ragged_batch(name, seed=6)
    outs = _decode_both_ways(cfg, params, tokens[:1], start[:1], ["ROUTE"])
    assert rel(outs["auto"][0], outs["xla"][0]) <= 3e-2
    ids = [np.asarray(tokens[0, :40]).tolist()]
    run = lambda: _generate(params, ids, 24)
    assert (_with_switches({"PDL_TRIGGER": False}, run) == run()).all(), \
        "generate with kernels signalling their dependents early, a token differs"


@pytest.mark.parametrize("name, int8", [("qwen3-30b-a3b", False), ("qwen3-30b-a3b", True),
                                        ("mixtral-8x7b", False)])
def test_moe_swiglu_in_the_reduction_same_bits(name, int8):
    """The gathered experts' SwiGLU as one variadic reduction (`layers.moe.MOE_SWIGLU_REDUCE`) against
    one reduction and a multiply kernel: the same bits, in decode steps and generate."""
    def on_and_off(run):  # run() with the switch on (as it stands), then off
        return run(), _with_switches({"MOE_SWIGLU_REDUCE": False}, run, module=moe_layers)
    cfg, params, tokens, start = _ragged_batch(name, seed=7)
    if int8:
        params = quantize_params(params)
    on, off = on_and_off(lambda: np.asarray(_prefill_and_decode(cfg, params, tokens[:1], start[:1])[0]))
    assert float(np.abs(on - off).max()) == 0, "decode logits"
    ids = [np.asarray(tokens[0, :40]).tolist()]
    on, off = on_and_off(lambda: _generate(params, ids, 24))
    assert (on == off).all(), "generate, a token differs"


# -- generate's loop ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_loop():
    cfg = PRESETS["smollm2-135m"]
    params = random_params(cfg, 0, jnp.bfloat16)
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (20, 33, 7)]
    return cfg, params, ids


def test_generate_loop_stops_each_row_at_its_stop_id(smollm2_loop):
    """generate's on-device loop (one CUDA graph, conditional nodes included) stops each row at its
    own stop id: the tokens before it as in a run without stop ids, the length, padding after."""
    cfg, params, ids = smollm2_loop
    free = _generate(params, ids, 40)
    first = lambda row, at: next((int(t) for n, t in enumerate(row) if n >= at and t not in row[:n]), -1)
    stops = [first(free[0], 5), first(free[1], 15)]  # ids that first come late in a row
    out = jaxllm.generate(params, ids, max_new_tokens=40, eos_token_ids=stops)
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    for b in range(len(ids)):
        hits = [n for n in range(40) if free[b, n] in stops]
        want = hits[0] + 1 if hits else 40
        n = int(lengths[b])
        assert n == want, f"row {b} length {n}, wanted {want}"
        assert (tokens[b, :n] == free[b, :n]).all(), f"row {b} tokens"
        assert (tokens[b, n:] == cfg.pad_id).all(), f"row {b} padding"


# Each a hint or a reordering of the same sums, so the tokens must not change without it:
# PDL_TRIGGER lets the next kernel launch early; PREFETCH_MAX_BYTES asks L2 for the next
# projection's weights; WEIGHTS_FIRST loads weights before the input; SQUARES_LAST makes the norm's
# sum of squares after the products (as weights-first kernels always do).
@pytest.mark.parametrize("switch, off, more", [("PDL_TRIGGER", False, {}),
                                               ("PREFETCH_MAX_BYTES", 0, {}),
                                               ("WEIGHTS_FIRST", False, {}),
                                               ("SQUARES_LAST", False, {"WEIGHTS_FIRST": False})])
def test_generate_tokens_unchanged_without(smollm2_loop, switch, off, more):
    """The batch's tokens, then its first row's alone: `project`'s kernels take batch-1 steps only,
    so the 3-row batch alone would not run them."""
    _, params, ids = smollm2_loop
    generated = lambda: np.concatenate([_generate(params, ids, 40), _generate(params, ids[:1], 40)])
    unchanged = generated()
    assert (_with_switches({switch: off, **more}, generated) == unchanged).all()


@pytest.mark.parametrize("quant", ["none", "int8"])
@pytest.mark.parametrize("switch", ["PREFETCH_LINES", "GATE_UP_WIDE"])
def test_generate_qwen3_widths_unchanged_without(quant, switch):
    """A layer that is not weights-first asks L2 a line at a time (PREFETCH_LINES): Qwen3-0.6B's o
    in bf16, its qkv, o and down in int8; a hint, so the same tokens with the bulk copy instead.
    Qwen3-0.6B's gate/up also loads twice the rows a program (GATE_UP_WIDE): each output a sum over
    the same chunk, so the same tokens as with the rows halved."""
    qwen = dataclasses.replace(PRESETS["qwen3-0.6b"], num_layers=4)
    rng = np.random.default_rng(0)
    for n in (20, 33, 7):  # the script's draws before these, so the same prompt
        rng.integers(0, PRESETS["smollm2-135m"].vocab_size, n)
    qwen_ids = [rng.integers(0, qwen.vocab_size, 40).tolist()]
    q_params = random_params(qwen, 0, jnp.bfloat16, quant=quant)
    q_run = lambda: _generate(q_params, qwen_ids, 32)
    stand = {"PREFETCH_LINES": True, "GATE_UP_WIDE": True}  # both on, as they stand
    on = _with_switches(stand, q_run)
    assert (on == _with_switches({**stand, switch: False}, q_run)).all()


# -- several GPUs ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["qwen3-0.6b", "llama3.2-1b"])
def test_tensor_parallel_matches_one_gpu(name):
    """4-layer models of real widths split over two GPUs (the decode kernel inside shard_map on each
    device's KV heads) against the same weights on one: a ragged prefill and 8 decode steps."""
    if jax.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {jax.device_count()}")
    from jaxllm.model import sharding
    from jaxllm.model.params import init_params
    step = jax.jit(model.step, static_argnames="fresh")
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
    assert rel(*outs) <= 3e-2


def test_every_kernel_family_compiles_here():
    """The step plan's compile probes pass on this GPU: no family falls back to XLA here."""
    from jaxllm.kernels import probe
    t = tuning_module.current()
    assert {f: probe.compiles(f, "gpu", t) for f in probe.PROBES} == dict.fromkeys(probe.PROBES, "gpu")
