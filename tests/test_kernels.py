"""The Pallas decode kernels against XLA's forms, run in Pallas' interpreter.

On a GPU the kernels run compiled (tests/gpu checks them there in bfloat16, `pytest -m gpu`); here the
interpreter executes the same kernel bodies, so their indexing, masking, splits, cache writes and
epilogues are checked in float32 against the reference functions in `layers`.
"""

import contextlib
import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxllm
from jaxllm import kernels, runtime
from jaxllm.kernels import common
from jaxllm.layers import dense as L
from jaxllm.model import plan
from jaxllm.layers.quant import QuantizedWeight, quantize, weight_leaves
from jaxllm.model.cache import init_cache
from jaxllm.model.params import quantize_params
from kernel_modes import decode_per_mode, prefill_and_decode, spy, tune, tuning

project_module = importlib.import_module("jaxllm.kernels.project")
rows_module = importlib.import_module("jaxllm.kernels.rows_project")
from tiny_models import random_tokens, rel_err


def _reference(qkv, k_cache, v_cache, end, start, inv_freq, window, q_norm, k_norm, eps, *,
               scale=None, softcap=None, norm_offset=0.0):
    """The XLA path of model._attention_block for one new token per row, row b's at slot end[b]."""
    B, K, J, H = qkv.shape
    G = J - 2
    positions = (end - start)[:, None]
    q = qkv[:, :, :G].reshape(B, 1, K * G, H)
    k, v = qkv[:, None, :, G], qkv[:, None, :, G + 1]
    if q_norm is not None:
        q, k = L.rms_norm(q, q_norm, eps, norm_offset), L.rms_norm(k, k_norm, eps, norm_offset)
    q, k = L.rope(q, positions, inv_freq), L.rope(k, positions, inv_freq)
    k_cache, v_cache = (c.at[jnp.arange(B), :, end].set(x) for c, x in ((k_cache, k[:, 0]), (v_cache, v[:, 0])))
    mask = L.visible_mask(end[:, None], start, k_cache.shape[2], window)
    return L.attention(q.reshape(B, 1, K, G, H), k_cache, v_cache, mask, scale=scale,
                       softcap=softcap)[:, 0], k_cache, v_cache


def _attention_inputs(seed, B, K, G, H, S, ends, qk_norm=False):
    """Random float32 (qkv, k cache, v cache, row ends, row starts, q_norm, k_norm, inv_freq,
    rotation) of a decode step writing row b at slot ends[b] (one number: every row there); the
    norms None unless qk_norm; the rotation's cos and sin by position, for all S (the kernel takes
    row b's at end_b - start_b)."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    qkv, k_cache, v_cache = normal(B, K, G + 2, H), normal(B, K, S, H), normal(B, K, S, H)
    end = np.broadcast_to(np.asarray(ends, np.int32), (B,))
    start = jnp.asarray(rng.integers(0, end), jnp.int32)
    q_norm, k_norm = (normal(H), normal(H)) if qk_norm else (None, None)
    inv_freq = jnp.asarray(1.0 / 10000 ** (np.arange(0, H, 2) / H), jnp.float32)
    angles = jnp.arange(S, dtype=jnp.float32)[:, None] * inv_freq
    rotation = jnp.stack([jnp.cos(angles), jnp.sin(angles)], axis=1)
    return qkv, k_cache, v_cache, jnp.asarray(end), start, q_norm, k_norm, inv_freq, rotation


@pytest.mark.slow
@pytest.mark.parametrize("B, K, G, H, S, ends, window, qk_norm", [
    (2, 2, 3, 64, 48, 20, None, False),  # one split, ragged starts
    (3, 1, 4, 32, 4096, 3000, None, True),  # many splits, Qwen3's per-head norms
    (2, 2, 2, 64, 160, 150, 8, False),  # a sliding window
    (1, 2, 1, 16, 2112, 1500, 100, False),  # splits of a cache length not a power of two
    (1, 1, 2, 16, 2048, 1023, None, False),  # the new token is the last slot of a split
    (3, 2, 3, 64, 48, [20, 5, 47], None, False),  # ragged ends in one split, one at the last slot
    (4, 1, 4, 32, 4096, [3000, 17, 1024, 4095], None, True),  # ragged ends in different splits
    (3, 2, 2, 64, 160, [150, 3, 64], 8, False),  # ragged ends under a sliding window
])
# Every grid large (full splits, or one split from B*K*H = 192: the first and third cases), small.
@pytest.mark.parametrize("multiprocessors", [1, 10**6])
def test_kernel_equals_xla_attention(monkeypatch, multiprocessors, B, K, G, H, S, ends, window,
                                     qk_norm):
    monkeypatch.setattr(runtime, "multiprocessors", lambda: multiprocessors)
    qkv, k_cache, v_cache, end, start, q_norm, k_norm, inv_freq, rotation = _attention_inputs(
        S + int(np.sum(ends)), B, K, G, H, S, ends, qk_norm)
    out, k, v = kernels.decode_attention(qkv, k_cache, v_cache, end, start, rotation,
                                         window=window, q_norm_H=q_norm, k_norm_H=k_norm,
                                         eps=1e-6, interpret=True)
    ref_out, ref_k, ref_v = _reference(qkv, k_cache, v_cache, end, start, inv_freq, window, q_norm,
                                       k_norm, 1e-6)
    np.testing.assert_allclose(out, ref_out, atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(k, ref_k, atol=1e-6)  # the rotated key, written at each row's end only
    np.testing.assert_array_equal(v, ref_v)


@pytest.mark.slow
@pytest.mark.parametrize("B, splits", [(4, 1), (2, 2)])  # B*K*H 256 (the bound), 128
def test_grids_that_fill_the_gpu_attend_in_one_split(monkeypatch, B, splits):
    """Where the (row, KV head) programs hold ONE_SPLIT_VALUES head values a multiprocessor, each
    streams its row's whole cache: the heads come back combined, with no splits to combine after."""
    monkeypatch.setattr(runtime, "multiprocessors", lambda: 1)
    tune(monkeypatch, one_split_values=256)
    K, G, H, S, ends = 2, 2, 32, 256, 200  # below the bound, splits of SPLIT_SLOTS (128) slots
    qkv, k_cache, v_cache, end, start, _, _, inv_freq, rotation = _attention_inputs(
        B, B, K, G, H, S, ends)
    out, k, _ = kernels.decode_attention(qkv, k_cache, v_cache, end, start, rotation,
                                         interpret=True, split_out=True)
    assert isinstance(out, kernels.SplitHeads) == (splits > 1)
    if splits > 1:
        assert out.acc.shape[1] == splits
        out = out.combined()
    ref_out, ref_k, _ = _reference(qkv, k_cache, v_cache, end, start, inv_freq, None, None, None,
                                   1e-6)
    np.testing.assert_allclose(out, ref_out, atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(k, ref_k, atol=1e-6)


def _verify_reference(qkv, k_cache, v_cache, end, start, inv_freq, window, q_norm, k_norm, eps, *,
                      scale=None, softcap=None, norm_offset=0.0):
    """The XLA path of model._attention_block for T new tokens per row, row b's at slots end[b]..."""
    B, T, K, J, H = qkv.shape
    G = J - 2
    slots = end[:, None] + jnp.arange(T)[None, :]
    positions = jnp.maximum(slots - start[:, None], 0)
    q = qkv[:, :, :, :G].reshape(B, T, K * G, H)
    k, v = qkv[:, :, :, G], qkv[:, :, :, G + 1]
    if q_norm is not None:
        q, k = L.rms_norm(q, q_norm, eps, norm_offset), L.rms_norm(k, k_norm, eps, norm_offset)
    q, k = L.rope(q, positions, inv_freq), L.rope(k, positions, inv_freq)
    write = jax.vmap(lambda cache, x, e: jax.lax.dynamic_update_slice(cache, x.transpose(1, 0, 2), (0, e, 0)))
    k_cache, v_cache = write(k_cache, k, end), write(v_cache, v, end)
    mask = L.visible_mask(slots, start, k_cache.shape[2], window)
    return (L.attention(q.reshape(B, T, K, G, H), k_cache, v_cache, mask, scale=scale, softcap=softcap),
            k_cache, v_cache)


def _verify_inputs(seed, B, T, K, G, H, S, ends, qk_norm=False):
    """`_attention_inputs` for T new tokens a row: qkv [B, T, K, G+2, H]; starts up to each end
    (a row may hold only its new tokens)."""
    qkv, *rest = _attention_inputs(seed, B, K, G, H, S, np.maximum(ends, 1), qk_norm)
    rng = np.random.default_rng(seed + 1)
    qkv = jnp.asarray(rng.normal(size=(B, T, K, G + 2, H)), jnp.float32)
    end = jnp.asarray(np.broadcast_to(np.asarray(ends, np.int32), (B,)))
    start = jnp.asarray(rng.integers(0, np.asarray(end) + 1), jnp.int32)
    return (qkv, rest[0], rest[1], end, start, *rest[4:])


_VERIFY_CASES = [  # B, K, G, H, S, T, ends, window, qk_norm
    (3, 2, 3, 32, 48, 5, [20, 7, 43], None, False),  # ragged ends, one at the cache's end
    (2, 1, 4, 16, 160, 9, [150, 3], 8, True),  # a window shorter than T, Qwen3's norms
    (3, 2, 1, 16, 64, 2, [62, 0, 33], None, False),  # the last two slots; a row of new tokens only
    (1, 2, 2, 16, 64, 4, [60], 3, False),  # the window inside the new tokens
    (2, 2, 2, 32, 2112, 8, [2104, 1023], 100, False),  # splits of a length not a power of two
    (4, 1, 4, 32, 512, 7, [505, 17, 128, 383], None, True),  # ends in different splits
    (2, 2, 2, 16, 96, 3, [62, 30], 5, False),  # new tokens across the end of a 64-slot split
    (1, 1, 8, 16, 64, 6, [40], None, False),  # G = 8: a query tile of 64 rows
]


def test_verify_attention_equals_xla(monkeypatch):
    """One case in the fast tier: ragged rows, a cache end, a window, several splits."""
    monkeypatch.setattr(runtime, "multiprocessors", lambda: 10**6)
    _check_verify_attention(*_VERIFY_CASES[0])


@pytest.mark.slow
@pytest.mark.parametrize("B, K, G, H, S, T, ends, window, qk_norm", _VERIFY_CASES)
@pytest.mark.parametrize("multiprocessors", [1, 10**6])  # large grids (long splits, or one), small
def test_verify_attention_kernel_equals_xla_attention(monkeypatch, multiprocessors, B, K, G, H, S,
                                                      T, ends, window, qk_norm):
    monkeypatch.setattr(runtime, "multiprocessors", lambda: multiprocessors)
    _check_verify_attention(B, K, G, H, S, T, ends, window, qk_norm)


def _check_verify_attention(B, K, G, H, S, T, ends, window, qk_norm):
    """T new tokens a row through `verify_attention` (interpreted) against XLA's masked form in
    float32: every query's heads, and the cache with each row's new keys and values written at
    end .. end + T - 1, nothing else."""
    qkv, k_cache, v_cache, end, start, q_norm, k_norm, inv_freq, rotation = _verify_inputs(
        S + T + int(np.sum(ends)), B, T, K, G, H, S, ends, qk_norm)
    out, k, v = kernels.verify_attention(qkv, k_cache, v_cache, end, start, rotation, window=window,
                                         q_norm_H=q_norm, k_norm_H=k_norm, eps=1e-6, interpret=True)
    ref_out, ref_k, ref_v = _verify_reference(qkv, k_cache, v_cache, end, start, inv_freq, window,
                                              q_norm, k_norm, 1e-6)
    assert out.shape == (B, T, K, G, H)
    np.testing.assert_allclose(out, ref_out, atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(k, ref_k, atol=1e-6)
    np.testing.assert_array_equal(v, ref_v)


def test_verify_attention_lowers_for_the_gpu(monkeypatch):
    """The kernel as Pallas lowers it to Triton for a Hopper GPU (what CI can check of the GPU
    form): the 8B shape's five tokens, and SmolLM2's nine under a window with Qwen3's norms."""
    monkeypatch.setattr(runtime, "gpu_generation", lambda: 9)
    monkeypatch.setattr(runtime, "multiprocessors", lambda: 132)
    for B, T, K, G, H, S, window, norm in [(1, 5, 8, 4, 128, 384, None, False),
                                           (4, 9, 3, 3, 64, 8448, 64, True)]:
        shape = lambda *s, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(s, dtype)
        args = [shape(B, T, K, G + 2, H), shape(B, K, S, H), shape(B, K, S, H),
                shape(B, dtype=jnp.int32), shape(B, dtype=jnp.int32),
                shape(S, 2, H // 2, dtype=jnp.float32)] + [shape(H) if norm else None] * 2
        call = jax.jit(lambda q, k, v, e, s, r, qn, kn: kernels.verify_attention(
            q, k, v, e, s, r, window=window, q_norm_H=qn, k_norm_H=kn))
        text = call.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "verify_attention" in text and "griddepcontrol.launch_dependents" in text


# Gemma's scores and q/k norms: a scale other than H^-1/2, a soft cap the scores exceed (scaled
# by 4 so that tanh bites), (1 + w) norms.
_GEMMA_SCORES = [
    dict(scale=24 ** -0.5, softcap=0.5),  # Gemma 2
    dict(scale=24 ** -0.5, norm_offset=1.0),  # Gemma 3 (with q/k norms)
]


@pytest.mark.parametrize("switches", _GEMMA_SCORES)
@pytest.mark.parametrize("multiprocessors", [1, 10**6])
def test_attention_kernels_take_gemmas_scores_and_norms(monkeypatch, multiprocessors, switches):
    """decode_attention (one token) and verify_attention (T tokens) with a static score scale, a
    soft cap or (1 + w) q/k norms, interpreted, against XLA's `layers.attention` in float32:
    ragged rows over several splits (small grids) or one, under a window."""
    monkeypatch.setattr(runtime, "multiprocessors", lambda: multiprocessors)
    qk_norm = "norm_offset" in switches
    B, K, G, H, S, ends, window = 3, 2, 2, 32, 160, [150, 3, 64], 8
    qkv, k_cache, v_cache, end, start, q_norm, k_norm, inv_freq, rotation = _attention_inputs(
        7, B, K, G, H, S, ends, qk_norm)
    qkv = qkv * 4
    out, k, v = kernels.decode_attention(qkv, k_cache, v_cache, end, start, rotation, window=window,
                                         q_norm_H=q_norm, k_norm_H=k_norm, eps=1e-6, interpret=True,
                                         **switches)
    ref_out, ref_k, ref_v = _reference(qkv, k_cache, v_cache, end, start, inv_freq, window, q_norm,
                                       k_norm, 1e-6, **switches)
    np.testing.assert_allclose(out, ref_out, atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(k, ref_k, atol=1e-6, rtol=1e-6)
    np.testing.assert_array_equal(v, ref_v)
    # the switches matter: XLA's attention without them differs
    plain = _reference(qkv, k_cache, v_cache, end, start, inv_freq, window, q_norm, k_norm, 1e-6)[0]
    assert np.abs(np.asarray(plain) - np.asarray(ref_out)).max() > 1e-2
    T, ends = 5, [150, 3, 40]
    qkv, k_cache, v_cache, end, start, q_norm, k_norm, inv_freq, rotation = _verify_inputs(
        8, B, T, K, G, H, S, ends, qk_norm)
    qkv = qkv * 4
    out, k, v = kernels.verify_attention(qkv, k_cache, v_cache, end, start, rotation, window=window,
                                         q_norm_H=q_norm, k_norm_H=k_norm, eps=1e-6, interpret=True,
                                         **switches)
    ref_out, ref_k, ref_v = _verify_reference(qkv, k_cache, v_cache, end, start, inv_freq, window,
                                              q_norm, k_norm, 1e-6, **switches)
    np.testing.assert_allclose(out, ref_out, atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(k, ref_k, atol=1e-6, rtol=1e-6)
    np.testing.assert_array_equal(v, ref_v)


def test_attention_kernels_lower_gemmas_switches_for_the_gpu(monkeypatch):
    """Both kernels with Gemma 2's scale and soft cap and Gemma 3's (1 + w) q/k norms, as Pallas
    lowers them to Triton for a Hopper GPU: gemma3-1b's heads of 256 (G = 4) and gemma2-2b's
    (G = 2)."""
    monkeypatch.setattr(runtime, "gpu_generation", lambda: 9)
    monkeypatch.setattr(runtime, "multiprocessors", lambda: 132)
    shape = lambda *s, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(s, dtype)
    for K, G, window, norm, switches in [(1, 4, 512, True, dict(scale=256 ** -0.5, norm_offset=1.0)),
                                         (4, 2, 4096, False, dict(scale=256 ** -0.5, softcap=50.0))]:
        B, H, S, T = 2, 256, 640, 5
        rest = [shape(B, K, S, H), shape(B, K, S, H), shape(B, dtype=jnp.int32),
                shape(B, dtype=jnp.int32), shape(S, 2, H // 2, dtype=jnp.float32)]
        rest += [shape(H) if norm else None] * 2
        for name, qkv in (("decode_attention", shape(B, K, G + 2, H)),
                          ("verify_attention", shape(B, T, K, G + 2, H))):
            fn = getattr(kernels, name)
            call = jax.jit(lambda q, k, v, e, s, r, qn, kn: fn(
                q, k, v, e, s, r, window=window, q_norm_H=qn, k_norm_H=kn, **switches))
            text = call.trace(qkv, *rest).lower(lowering_platforms=("cuda",)).as_text()
            assert name in text and "griddepcontrol.launch_dependents" in text
            assert ("tanh" in text) == ("softcap" in switches), name


def _interpreted(monkeypatch, switch: str):
    """Decode steps take the kernel behind `switch`, interpreted; jit caches cleared around it."""
    tune(monkeypatch, **{switch: "interpret"})
    yield
    jax.clear_caches()


@contextlib.contextmanager
def _interpreted_within(switch: str):
    """`_interpreted` for a block of a test (its own monkeypatch, undone at the block's end)."""
    with pytest.MonkeyPatch.context() as patch:
        yield from _interpreted(patch, switch)


@pytest.fixture
def kernel_mode(monkeypatch):
    yield from _interpreted(monkeypatch, "decode_attention")


def test_auto_mode_keeps_float32_and_cpu_on_xla():
    assert tuning().decode_attention == "auto"
    assert plan.decode_attention_mode(jnp.float32, 64, 64, False, 384) is None
    assert plan.decode_attention_mode(jnp.bfloat16, 64, 64, False, 384) is None  # no GPU here


def test_kernel_refuses_what_it_cannot_run(kernel_mode):
    assert plan.decode_attention_mode(jnp.float32, 64, 64, False, 384) == "interpret"
    assert plan.decode_attention_mode(jnp.float32, 64, 64, True, 384) is None  # int8 cache
    assert plan.decode_attention_mode(jnp.float32, 64, 32, False, 384) is None  # partial rotary
    assert plan.decode_attention_mode(jnp.float32, 96, 96, False, 384) is None  # halves of 48
    assert plan.decode_attention_mode(jnp.float32, 64, 64, False, 100) is None  # 100 % 16


@pytest.mark.slow
def test_generate_makes_the_rotation_table_once_and_keeps_the_tokens(monkeypatch, tiny):
    """Through the attention kernel, generate and stream make every position's cos and sin once,
    before their loops (no step makes its own), and the tokens are XLA's (a ragged batch's)."""
    params = tiny("qwen3").params
    prompts = [random_tokens(n, seed=n).tolist() for n in (5, 13)]
    run = lambda: np.asarray(jaxllm.generate(params, prompts, max_new_tokens=12,
                                             eos_token_ids=[]).tokens)
    want = run()
    loops = importlib.import_module("jaxllm.engine.generate")  # the module; jaxllm.generate is its function
    looped = spy(monkeypatch, "rotation_table", lambda cfg, length: length, module=loops)
    stepped = spy(monkeypatch, "rotation_table", lambda cfg, length: length,
                  module=importlib.import_module("jaxllm.model.transformer"))
    with _interpreted_within("decode_attention"):
        np.testing.assert_array_equal(run(), want)
        streamed = list(jaxllm.stream(params, prompts[1], max_new_tokens=12, eos_token_ids=[]))
    assert streamed == want[1].tolist()
    assert looped == [32, 32] and stepped == []  # the cache's slots: 16 of prompt, 12 new, padded


@pytest.fixture
def project_mode(monkeypatch):
    yield from _interpreted(monkeypatch, "decode_project")


@pytest.fixture
def mosaic_interpreter(monkeypatch):
    """Mosaic GPU kernels in "interpret" mode run in Mosaic GPU's interpreter, whose params JAX
    0.10 names only under jax._src (which the package does not import, so tests hand them in)."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    monkeypatch.setattr(common, "MOSAIC_INTERPRET", InterpretGPUParams())


def _decode_matches_forward(m, rows: int = 2, kernels_on=contextlib.nullcontext):
    """Prefill 8 tokens then decode 6, the last row left-padded: logits equal the full forward's
    (computed outside `kernels_on`, the cached steps inside)."""
    ids = random_tokens((2, 14), seed=3)
    ids[1, :3] = m.params.config.pad_id  # row 1 left-padded: its start is 3
    full = np.array(jaxllm.forward(m.params, ids))
    full[1, 3:] = np.asarray(jaxllm.forward(m.params, ids[1:, 3:]))[0]
    ids, full, start = ids[-rows:], full[-rows:], jnp.asarray([0, 3][-rows:])
    with kernels_on():
        cache = init_cache(m.params.config, rows, 32, jnp.float32, start=start)
        steps = prefill_and_decode(m.params, ids, 8, cache)
    assert rel_err(np.stack(steps, 1), full[:, 7:14]) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2_swa", "qwen3"])
def test_decode_through_the_kernel_matches_the_full_forward(kernel_mode, tiny, name):
    m = tiny(name)
    assert plan.decode_attention_mode(jnp.float32, m.params.config.head_dim,
                                         m.params.config.head_dim, False, 32) == "interpret"
    _decode_matches_forward(m)


@pytest.mark.slow
def test_generate_through_the_kernel_matches_transformers(kernel_mode, tiny):
    from tiny_models import hf_greedy
    m = tiny("mistral")  # sliding window 4: the kernel's window bound is exercised at every step
    prompt = random_tokens((1, 9), seed=5)
    out = jaxllm.generate(m.params, prompt, max_new_tokens=12, eos_token_ids=[])
    ref, _ = hf_greedy(m.hf, m.params.config, prompt, 12)
    np.testing.assert_array_equal(np.asarray(out.tokens), ref)


def _project_cases(M):
    """(name, x, w, keywords) of each form a decode layer uses, float32 and int8 weights."""
    key = jax.random.key(M)
    r = lambda i, shape: jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)
    C, N, F = 80, 48, 32  # C: 80 of a padded 128 (or three chunks of 32, the last masked)
    x, g, b, res = r(0, (M, C)), 1 + r(1, (C,)) / 4, r(2, (N,)), r(3, (M, N))
    w, w_gate_up = r(4, (N, C)) / 8, r(5, (2, F, C)) / 8
    q = lambda w: QuantizedWeight(jax.random.randint(jax.random.fold_in(key, 9), w.shape, -127, 128,
                                                     jnp.int8), jnp.abs(r(6, w.shape[:-1])) / 200,
                                  jnp.float32)
    return [("norm + qkv + bias", x, w, dict(norm_C=g, eps=1e-5, bias_N=b)),
            ("o + bias + residual", x, w, dict(bias_N=b, residual_MN=res)),
            ("norm + gate/up + swiglu", x, w_gate_up, dict(norm_C=g, swiglu=True)),
            ("down + residual", x, w, dict(residual_MN=res)),
            ("norm + lm_head in float32", x, w, dict(norm_C=g, out_dtype=jnp.float32)),
            ("int8 qkv", x, q(w), dict(norm_C=g)),
            ("int8 gate/up + swiglu", x, q(w_gate_up), dict(norm_C=g, swiglu=True)),
            ("int8 down + residual", x, q(w), dict(residual_MN=res))]


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [4096, 32])  # the input channels in one load, then in 3
def test_project_kernel_equals_xla(monkeypatch, chunk):
    tune(monkeypatch, max_chunk=chunk)
    tune(monkeypatch, one_chunk_channels=chunk)
    for name, x, w, kw in _project_cases(1):
        out = kernels.project(x, w, mode="interpret", **kw)
        ref = kernels.project(x, w, mode=None, **kw)
        assert out.shape == ref.shape and out.dtype == ref.dtype, name
        assert rel_err(np.asarray(out), np.asarray(ref)) < 1e-5, name
        # Weights loaded before x (one chunk; several ignore it), or the norm's squares made
        # before the products: the same sums, bit for bit.
        first = kernels.project(x, w, mode="interpret", weights_first=True, **kw)
        np.testing.assert_array_equal(np.asarray(first), np.asarray(out), err_msg=name)
        tune(monkeypatch, squares_last=False)
        before = kernels.project(x, w, mode="interpret", **kw)
        tune(monkeypatch, squares_last=True)
        np.testing.assert_array_equal(np.asarray(before), np.asarray(out), err_msg=name)
        if kw.get("swiglu"):
            # gate/up's rows halved, as where its weights are asked of L2 ahead (16 outputs a
            # program at one chunk here, against the 32 of GATE_UP_WIDE, which the interpreter
            # always takes): XLA's answer too (the bits may differ, the tile's sums vectorized
            # otherwise on the CPU).
            tune(monkeypatch, gate_up_wide=False)
            halved = kernels.project(x, w, mode="interpret", **kw)
            tune(monkeypatch, gate_up_wide=True)
            assert rel_err(np.asarray(halved), np.asarray(ref)) < 1e-5, name


def _mosaic_project_cases(dtype):
    """(name, x, w, keywords) of each form a decode layer uses, in widths of whole 64s (the Mosaic
    GPU form's): C = 192 is three blocks of 64, 128 one block of 128; the norm's row padded."""
    key = jax.random.key(5)
    r = lambda i, shape: jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32).astype(dtype)
    C, N, F = 192, 128, 64
    x, g, b, res = r(0, (1, C)), 1 + r(1, (C,)) / 4, r(2, (N,)), r(3, (1, N))
    w, w_gate_up = r(4, (N, C)) / 8, r(5, (2, F, C)) / 8
    return [("norm + qkv + bias", x, w, dict(norm_C=g, eps=1e-5, bias_N=b)),
            ("o + bias + residual", x, w, dict(bias_N=b, residual_MN=res)),
            ("norm + gate/up + swiglu", x, w_gate_up, dict(norm_C=g, swiglu=True)),
            ("gate/up + GeGLU", x[:, :128], w_gate_up[..., :128], dict(swiglu=True, activation="gelu_tanh")),
            ("norm + lm_head in float32", x, w, dict(norm_C=g, out_dtype=jnp.float32)),
            ("int8 norm + qkv + residual", x[:, :128], quantize(w[:, :128]),
             dict(norm_C=g[:128], residual_MN=res)),
            ("int8 gate/up + swiglu", x[:, :128], quantize(w_gate_up[..., :128]), dict(swiglu=True))]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_project_on_mosaic_gpu_equals_xla(monkeypatch, mosaic_interpreter, dtype):
    """`project`'s Mosaic GPU form (JAXLLM_PROJECT_BACKEND=mosaic_gpu), in Mosaic GPU's
    interpreter: in float32 XLA's result as closely as the Triton kernel's test asks; in bfloat16
    the Triton kernel's to a rounding of the output (both scale by the norm after the sums, where
    XLA rounds the normed row first: up to 1.4e-2 apart from XLA here); a program a tile of 64
    output channels."""
    cases = _mosaic_project_cases(dtype)
    triton = [kernels.project(x, w, mode="interpret", **kw) for _, x, w, kw in cases]
    tune(monkeypatch, project_backend="mosaic_gpu")
    calls = spy(monkeypatch, "_mosaic_project_call", lambda x, w, *a: w.shape)
    for (name, x, w, kw), by_triton in zip(cases, triton):
        out = kernels.project(x, w, mode="interpret", **kw)
        ref = kernels.project(x, w, mode=None, **kw) if dtype == jnp.float32 else by_triton
        assert out.shape == ref.shape and out.dtype == ref.dtype, name
        assert rel_err(np.asarray(out, np.float32), np.asarray(ref, np.float32)) < (
            1e-5 if dtype == jnp.float32 else 2 ** -7), name
    assert calls == [w.shape for _, _, w, _ in cases]


def test_project_on_mosaic_gpu_leaves_what_it_cannot_take_to_the_triton_kernel(monkeypatch):
    """Widths not in whole 64s take the Triton kernel under the Mosaic GPU backend, float or
    int8, as do matrices of another dtype than the row's."""
    tune(monkeypatch, project_backend="mosaic_gpu")
    mosaic = spy(monkeypatch, "_mosaic_project_call")
    triton = spy(monkeypatch, "_project_kernel_call", module=project_module)
    _, x, w, _ = _project_cases(1)[1]  # 48 x 80
    x64 = jnp.ones((1, 64), jnp.float32)
    for row, matrix in ((x, w), (x, quantize(w)), (x64, jnp.ones((64, 64), jnp.bfloat16))):
        kernels.project(row, matrix, mode="interpret")
    assert (len(mosaic), len(triton)) == (0, 3)


@pytest.mark.slow
def test_decode_through_project_on_mosaic_gpu_matches_the_full_forward(monkeypatch, mosaic_interpreter, tiny):
    """A tiny model's batch-1 decode steps with its projections on the Mosaic GPU form where their
    widths are whole 64s (qkv, o, the lm_head), on the Triton kernel where not (gate/up and down,
    of 96), give the full forward's logits; in int8, XLA's logits."""
    m = tiny("llama")
    tune(monkeypatch, project_backend="mosaic_gpu")
    mosaic = spy(monkeypatch, "_mosaic_project_call", lambda x, w, *a: w.shape)
    triton = spy(monkeypatch, "_project_kernel_call", lambda x, w, *a: w.shape, module=project_module)
    _decode_matches_forward(m, rows=1, kernels_on=lambda: _interpreted_within("decode_project"))
    assert mosaic and triton
    # int8 weights: the 64-wide ones on Mosaic GPU, the others on Triton, against XLA's steps
    mosaic.clear()
    params = quantize_params(m.params)
    runs = decode_per_mode(monkeypatch, params, random_tokens((1, 6), seed=4), 4, ["decode_project"])
    assert rel_err(runs[1], runs[0]) < 1e-5 and mosaic


def _split_heads(splits, K=3, G=3, H=16, seed=0):
    """Random `SplitHeads` of one row, as the attention kernel leaves them (every split but the
    last saw some slots; the last none: maximum -1e30, sums 0)."""
    key = jax.random.key(seed)
    r = lambda i, shape: jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)
    acc, m, l = r(0, (1, splits, K, G, H)), r(1, (1, splits, K, G)), 1 + jnp.abs(r(2, (1, splits, K, G)))
    empty = jnp.arange(splits)[None, :, None, None] == splits - 1
    acc = jnp.where(empty[..., None], 0.0, acc)
    return kernels.SplitHeads(acc, jnp.where(empty, common.NEG, m), jnp.where(empty, 0.0, l),
                              dtype=jnp.float32)


@pytest.mark.slow
@pytest.mark.parametrize("splits, int8", [(2, False), (3, False), (8, False), (3, True)])
def test_project_kernel_combines_split_heads(splits, int8):
    """The o projection from uncombined attention splits equals it from XLA's combine: K*G = 9
    rows of heads padded to 16 in the kernel, splits padded to a power of two."""
    heads = _split_heads(splits)
    key = jax.random.key(splits)
    w, b, res = (jax.random.normal(jax.random.fold_in(key, i), shape) for i, shape in
                 enumerate([(40, 144), (40,), (1, 40)]))
    if int8:
        w = quantize(w)
    out = kernels.project(heads, w, bias_N=b, residual_MN=res, mode="interpret")
    ref = kernels.project(heads.combined().reshape(1, 144), w, bias_N=b, residual_MN=res, mode=None)
    assert out.shape == ref.shape == (1, 40)
    assert rel_err(np.asarray(out), np.asarray(ref)) < 1e-5
    xla = kernels.project(heads, w, bias_N=b, residual_MN=res, mode=None)  # combined by XLA
    np.testing.assert_array_equal(np.asarray(xla), np.asarray(ref))


@pytest.mark.slow
def test_split_heads_too_large_for_registers_are_combined_by_xla(monkeypatch):
    """Splits too many for a program's registers: XLA combines them, the kernel still projects the
    combined row; a matrix too large for the kernel: XLA does both."""
    calls = spy(monkeypatch, "_project_kernel_call", record=lambda x, *rest: x)
    heads, w = _split_heads(3), jax.random.normal(jax.random.key(5), (8, 144))
    assert project_module.heads_values(heads) == 4 * 16 * 16
    kernels.project(heads, w, mode="interpret")
    assert len(calls) == 1 and isinstance(calls[-1], kernels.SplitHeads)
    ref = kernels.project(heads.combined().reshape(1, 144), w, mode=None)
    tune(monkeypatch, fused_heads_values=4 * 16 * 16 - 1)
    out = kernels.project(heads, w, mode="interpret")
    assert len(calls) == 2 and calls[-1].shape == (1, 144)  # the combined row
    assert rel_err(np.asarray(out), np.asarray(ref)) < 1e-5
    tune(monkeypatch, kernel_max_weights=8 * 144 - 1)
    out = kernels.project(heads, w, mode="interpret")
    assert len(calls) == 2  # the kernel ran no more: XLA combined the splits and projected
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


def test_project_mode_rules(monkeypatch):
    assert tuning().decode_project == "auto"
    assert plan.decode_project_mode(jnp.float32, 1) is None
    assert plan.decode_project_mode(jnp.bfloat16, 1) is None  # no GPU here
    tune(monkeypatch, decode_project="interpret")
    assert plan.decode_project_mode(jnp.float32, 1) == "interpret"
    assert plan.decode_project_mode(jnp.float32, 2) is None  # one row only


def test_project_keeps_large_matrices_and_batches_on_xla(monkeypatch):
    """The kernel only where it measured faster: one row, at most KERNEL_MAX_WEIGHTS weights."""
    calls = spy(monkeypatch, "_project_kernel_call")
    x, w = jnp.ones((1, 64)), jnp.ones((32, 64))
    kernels.project(x, w, mode="interpret")
    assert len(calls) == 1
    kernels.project(jnp.ones((2, 64)), w, mode="interpret")  # two rows
    tune(monkeypatch, kernel_max_weights=32 * 64 - 1)
    kernels.project(x, w, mode="interpret")  # one weight too many
    assert len(calls) == 1


@pytest.mark.slow
def test_float_rows_up_to_one_chunk_channels_load_in_one_chunk(monkeypatch):
    """A float row of 3072 channels (Qwen3-0.6B's down) loads as one padded chunk of 4096, past
    MAX_CHUNK; one of 8192 in chunks of MAX_CHUNK; int8 rows keep their own tiles. The sums
    match XLA's either way."""
    chunks, real = [], project_module._project_kernel_call
    monkeypatch.setattr(project_module, "_project_kernel_call", lambda *a, **k: chunks.append(
        (a[1].shape[-1], k["chunk"], k["rows"])) or real(*a, **k))
    for C in (3072, 8192):
        x = jax.random.normal(jax.random.key(C), (1, C))
        w = jax.random.normal(jax.random.key(1), (8, C)) / 64
        res = jnp.ones((1, 8))
        out = kernels.project(x, w, residual_MN=res, mode="interpret")
        ref = kernels.project(x, w, residual_MN=res, mode=None)
        assert rel_err(np.asarray(out), np.asarray(ref)) < 1e-5
    assert chunks == [(3072, 4096, 2), (8192, tuning().max_chunk, 2)] and tuning().max_chunk < 4096
    kernels.project(jnp.ones((1, 3072)), quantize(jnp.ones((8, 3072))), mode="interpret")
    assert chunks[-1] == (3072, tuning().max_chunk, 2)  # int8: as before
    tune(monkeypatch, one_chunk_channels=tuning().max_chunk)  # the switch off
    kernels.project(jnp.ones((1, 3072)), jnp.ones((8, 3072)), mode="interpret")
    assert chunks[-1] == (3072, tuning().max_chunk, 2)


@pytest.mark.slow
def test_project_takes_int8_matrices_past_the_float_limit_in_their_own_tiles(monkeypatch):
    """int8 weights take the kernel up to KERNEL_MAX_INT8_WEIGHTS (it converts them without I2F
    on a GPU), those past KERNEL_MAX_WEIGHTS in INT8_TILES; a float matrix that size stays on XLA."""
    tiles, real = [], project_module._project_kernel_call
    monkeypatch.setattr(project_module, "_project_kernel_call", lambda *a, **k: tiles.append(
        (k["rows"], k["chunk"], k["warps"])) or real(*a, **k))
    tune(monkeypatch, kernel_max_weights=32 * 64 - 1)
    tune(monkeypatch, kernel_max_int8_weights=32 * 64)
    tune(monkeypatch, int8_tiles=(8, 32, 2))
    key = jax.random.key(3)
    x, w = jax.random.normal(key, (1, 64)), jax.random.normal(jax.random.fold_in(key, 1), (32, 64))
    kernels.project(x, w, mode="interpret")
    assert tiles == []
    out = kernels.project(x, quantize(w), mode="interpret")
    assert tiles == [(8, 32, 2)]  # 8 rows a program, in chunks of 32 channels, twice
    assert rel_err(np.asarray(out), np.asarray(kernels.project(x, quantize(w), mode=None))) < 1e-5
    # 96 channels in chunks of at most 64: three whole chunks of 32, not an overlapping second
    # 64; SwiGLU's gate and up each 8 rows a program.
    x96, w96 = jax.random.normal(key, (1, 96)), jax.random.normal(jax.random.fold_in(key, 2), (2, 16, 96))
    tune(monkeypatch, int8_tiles=(8, 64, 2))
    tune(monkeypatch, kernel_max_int8_weights=2 * 16 * 96)
    out = kernels.project(x96, quantize(w96), swiglu=True, mode="interpret")
    assert tiles[-1] == (8, 32, 2)
    ref = kernels.project(x96, quantize(w96), swiglu=True, mode=None)
    assert rel_err(np.asarray(out), np.asarray(ref)) < 1e-5
    tune(monkeypatch, kernel_max_int8_weights=32 * 64 - 1)
    kernels.project(x, quantize(w), mode="interpret")
    assert len(tiles) == 2


def test_projections_ask_l2_for_the_matrix_read_next(monkeypatch, project_mode, tiny):
    """A batch-1 step's projection kernels each ask L2 for the matrix the step reads next: qkv's
    for o's, o's for gate/up, gate/up's for down, down's for the next layer's qkv, the last
    layer's for the lm_head (plan.prefetched says which; here every matrix)."""
    from jaxllm.model import transformer as model
    asks, real = [], kernels.project
    monkeypatch.setattr(kernels, "project", lambda x, w, **k: asks.append(
        (w.shape, [a.shape for a in k.get("prefetch", ()) if a is not None])) or real(x, w, **k))
    monkeypatch.setattr(plan, "prefetched", lambda w, tuning=None: w is not None)
    params = tiny("llama").params
    layer, head = params.layers[0], params.embed if params.lm_head is None else params.lm_head
    cache = init_cache(params.config, 1, 16, jnp.float32)
    jax.clear_caches()
    jax.jit(model.step).trace(params, jnp.zeros((1, 1), jnp.int32), cache)
    jax.clear_caches()
    D = params.config.hidden_size
    reads = [(-1, D), (D, -1), layer.w_gate_up.shape, layer.w_down.shape]  # as `project` gets them
    want = [layer.wo.shape, layer.w_gate_up.shape, layer.w_down.shape]
    # Layers of one kind trace once: the first layer's kind, then the last one's, then the lm_head.
    assert [asked for _, asked in asks] == (
        [[s] for s in want + [layer.wqkv.shape]] + [[s] for s in want + [head.shape]] + [[]])
    for (shape, _), read in zip(asks, 2 * reads):
        assert len(shape) == len(read) and all(r in (-1, n) for r, n in zip(read, shape))


def _probes_pass(monkeypatch):
    """The step plan's compile probes as on a Hopper GPU where every kernel compiles."""
    monkeypatch.setattr(runtime, "gpu_generation", lambda: 9)
    monkeypatch.setattr(plan, "compiles", lambda family, mode, tuning, **variant: mode)


def test_prefetch_rules(monkeypatch):
    """Matrices of at most PREFETCH_MAX_BYTES are asked for (int8 ones by their bytes), on a GPU
    from Hopper on."""
    limit = tuning().prefetch_max_bytes
    assert limit == 4 * 2**20
    small, large = jnp.zeros((1024, 2048), jnp.bfloat16), jnp.zeros((1024, 2049), jnp.bfloat16)
    assert not plan.prefetched(small)  # no GPU here
    _probes_pass(monkeypatch)
    assert plan.prefetched(small) and not plan.prefetched(large)
    assert plan.prefetched(quantize(large.astype(jnp.float32))) and not plan.prefetched(None)
    tune(monkeypatch, prefetch_max_bytes=0)
    assert not plan.prefetched(small)
    monkeypatch.setattr(runtime, "gpu_generation", lambda: 8)
    tune(monkeypatch, prefetch_max_bytes=limit)
    assert not plan.prefetched(small)


def test_a_prefetch_that_does_not_compile_is_left_out_with_one_warning(monkeypatch):
    """The ask is a hint: where it fails to compile, the projections keep their kernels and
    ask for nothing, after one line that says so."""
    from jaxllm.kernels import probe

    def broken(mode, t):
        raise NotImplementedError("no lowering for this asm")
    monkeypatch.setattr(runtime, "gpu_generation", lambda: 9)
    monkeypatch.setattr(probe, "_results", {})
    monkeypatch.setattr(runtime, "_fallen_back", set())
    monkeypatch.setitem(probe.PROBES, "l2_prefetch", broken)
    small = jnp.zeros((1024, 2048), jnp.bfloat16)
    with pytest.warns(runtime.KernelFallbackWarning) as caught:
        assert not plan.prefetched(small) and not plan.prefetched(small)
    assert [str(w.message) for w in caught] == [
        "jaxllm: the l2_prefetch kernel is left out (the projections ask L2 for nothing): its kernel "
        "does not compile here (NotImplementedError: no lowering for this asm)"]


def test_prefetch_lowers_in_the_triton_kernel():
    """The ask lowers to Hopper's bulk L2 prefetch (or a line at a time) inside the Triton kernel,
    through Pallas' public inline asm."""

    def lowered(*ahead, lines=False):
        call = lambda x, w, *a: project_module._project_kernel_call(
            x, w, None, None, None, a, eps=1e-6, swiglu=False, out_dtype=jnp.dtype(jnp.bfloat16),
            rows=4, chunk=1024, warps=4, interpret=False, lines=lines)
        args = [jax.ShapeDtypeStruct((1, 1024), jnp.bfloat16),
                jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16), *ahead]
        return jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    later = jax.ShapeDtypeStruct((1024, 2048), jnp.bfloat16)
    assert "cp.async.bulk.prefetch.L2" in lowered(later)
    assert "prefetch.global.L2::evict_last" in lowered(later, lines=True)
    assert "prefetch" not in lowered()


@pytest.mark.parametrize("nbytes, programs, lines", [(4 * 2**20, 1024, False), (663552, 288, False),
                                                     (2**20, 512, True), (2**22, 4096, True)])
def test_prefetch_asm_deals_the_whole_matrix(nbytes, programs, lines):
    """The deal the ask's asm computes for every lane of every program, with the constants the
    asm carries: the pieces cover the matrix and nothing past its end (bulk sizes of 16s; lines
    whole, each asked for once)."""
    stride, piece = common.prefetch_pieces(nbytes, programs, 128, lines)
    asm = common.prefetch_asm(nbytes, programs, stride, piece, lines)
    t, p = np.arange(128)[:, None], np.arange(programs)[None, :]
    q = t * stride + p - (programs - stride)
    count = np.where(q < 0, 0, np.clip(nbytes - q * piece, 0, piece))
    assert f"mad.lo.s32 q, t, {stride}, $2;" in asm and f"sub.s32 q, q, {programs - stride};" in asm
    assert f"mul.lo.s32 c, q, {-piece};" in asm and f"add.s32 c, c, {nbytes};" in asm
    covered = np.zeros(nbytes + piece, np.int32)
    for start, n in zip((q * piece)[count > 0], count[count > 0]):
        covered[start:start + n] += 1
    assert not covered[nbytes:].any()
    if lines:  # whole lines, each asked for once, as many instructions as a piece has lines
        assert (covered[:nbytes] == 1).all()
        assert piece % 128 == 0 and asm.count("prefetch.global.L2::evict_last") == piece // 128
    else:  # each piece asked for once in every stride-th program (the last among the last stride)
        assert (covered[:nbytes] >= 1).all() and (count % 16 == 0).all()
        assert asm.count("cp.async.bulk.prefetch.L2") == 1


def _kernel_reads(weights_first: bool, squares_last: bool = False):
    """The loads (by the shape read) and reductions of a norm + qkv program, in program order."""
    call = lambda x, w, g: project_module._project_kernel_call(
        x, w, g, None, None, (), eps=1e-6, swiglu=False, out_dtype=jnp.dtype(jnp.bfloat16),
        rows=4, chunk=1024, warps=4, interpret=False, weights_first=weights_first,
        squares_last=squares_last)
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((1, 1024), (4096, 1024), (1024,))]

    def pallas_calls(jaxpr):  # through the jit around the call
        for e in jaxpr.eqns:
            if e.primitive.name == "pallas_call":
                yield e.params["jaxpr"]
            for sub in e.params.values():
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    yield from pallas_calls(getattr(sub, "jaxpr", sub))

    (kernel,) = pallas_calls(jax.make_jaxpr(call)(*args).jaxpr)
    return [e.primitive.name if "reduce" in e.primitive.name else e.invars[0].aval.shape
            for e in kernel.eqns if "load" in e.primitive.name or "reduce" in e.primitive.name]


def test_weights_first_asks_for_every_load_before_any_reduction():
    """As WEIGHTS_FIRST says: the weights, then x and the norm's weight, then the sums. With the
    squares last (SQUARES_LAST) x comes first, then the weights, then the sums; else the norm's
    sum of squares comes between x and the weights."""
    assert _kernel_reads(True) == [(4, 1024), (1, 1024), (1024,), "reduce_sum", "reduce_sum"]
    assert _kernel_reads(False, squares_last=True) == [
        (1, 1024), (1024,), (4, 1024), "reduce_sum", "reduce_sum"]
    assert _kernel_reads(False) == [(1, 1024), "reduce_sum", (1024,), (4, 1024), "reduce_sum"]


def test_float_matrices_make_the_squares_last(monkeypatch):
    """`project` asks its kernel for the squares after the products (SQUARES_LAST) for a float
    matrix, not for an int8 one (that order measured slower there), nor with the switch off."""
    asked, real = [], project_module._project_kernel_call
    monkeypatch.setattr(project_module, "_project_kernel_call", lambda *a, **k: asked.append(
        k["squares_last"]) or real(*a, **k))
    x, w, g = jnp.ones((1, 64)), jax.random.normal(jax.random.key(0), (32, 64)), jnp.ones((64,))
    kernels.project(x, w, norm_C=g, mode="interpret")
    kernels.project(x, quantize(w), norm_C=g, mode="interpret")
    tune(monkeypatch, squares_last=False)
    kernels.project(x, w, norm_C=g, mode="interpret")
    assert asked == [True, False, False]


def test_weights_first_rules(monkeypatch):
    """A layer loads its weights before x only where every projection matrix is a float one that
    `prefetched` asks L2 for: on a GPU from Hopper on, each at most PREFETCH_MAX_BYTES."""
    small, large = jnp.zeros((1024, 2048), jnp.bfloat16), jnp.zeros((1024, 2049), jnp.bfloat16)
    assert not plan.weights_first([small])  # no GPU here
    _probes_pass(monkeypatch)
    assert plan.weights_first([small, small])
    assert not plan.weights_first([small, large])  # one from HBM: as before
    assert not plan.weights_first([small, quantize(small.astype(jnp.float32))])  # int8
    assert not plan.weights_first([small, None])  # a MoE layer's FFN
    zeros = lambda *shapes: [jnp.zeros(shape, jnp.bfloat16) for shape in shapes]
    # SmolLM2-135M's layer (qkv, o, gate/up, down) qualifies; Qwen3-0.6B's qkv (8 MB) does not.
    assert plan.weights_first(zeros((960, 576), (576, 576), (2, 1536, 576), (576, 1536)))
    assert not plan.weights_first(zeros((4096, 1024), (1024, 2048), (2, 3072, 1024), (1024, 3072)))
    tune(monkeypatch, weights_first=False)
    assert not plan.weights_first([small])


@pytest.mark.slow
@pytest.mark.parametrize("first", [False, True])
def test_layers_pass_weights_first_to_their_projections(monkeypatch, project_mode, tiny, first):
    """Each layer's four projection kernels get the layer's `plan.weights_first`, the lm_head
    never; a decode step with weights first matches the full forward."""
    from jaxllm.model import transformer as model
    asked, real = [], kernels.project
    monkeypatch.setattr(kernels, "project", lambda x, w, **k: asked.append(
        k.get("weights_first", False)) or real(x, w, **k))
    monkeypatch.setattr(plan, "weights_first", lambda matrices, tuning=None: first and len(matrices) == 4)
    m = tiny("llama")
    cache = init_cache(m.params.config, 1, 16, jnp.float32)
    jax.clear_caches()
    jax.jit(model.step).trace(m.params, jnp.zeros((1, 1), jnp.int32), cache)
    # Layers of one kind trace once (four projections each), then the lm_head.
    assert len(asked) % 4 == 1 and asked[:-1] == [first] * (len(asked) - 1) and not asked[-1]
    _decode_matches_forward(m, rows=1)
    jax.clear_caches()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama_bias", "qwen3", "qwen2_swa"])
def test_decode_through_both_kernels_matches_the_full_forward(monkeypatch, kernel_mode,
                                                              project_mode, tiny, name):
    """qkv bias, o bias, Qwen3's norms and a tied lm_head, sliding windows: every fused form.
    One row: the projection kernel takes batch 1 only. The 32-slot cache splits 4 ways (blocks of
    8 slots, splits of 8), so the o projection combines the attention's splits."""
    assert plan.decode_project_mode(jnp.float32, 1) == "interpret"
    tune(monkeypatch, block_slots=8)
    tune(monkeypatch, split_slots=16)
    combined = spy(monkeypatch, "_combined_heads", lambda *a: a[3])  # the splits
    _decode_matches_forward(tiny(name), rows=1)
    assert combined and set(combined) == {4}  # traced with 4 splits


@pytest.mark.slow
def test_int8_decode_through_the_projection_kernel_matches_xla(monkeypatch, tiny):
    params = quantize_params(tiny("llama_tied").params)  # the tied table, quantized, is the lm_head
    runs = decode_per_mode(monkeypatch, params, random_tokens((1, 6), seed=4), 4, ["decode_project"])
    assert rel_err(runs[1], runs[0]) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("apart, digits, down", [(True, True, True), (True, True, False),
                                                 (True, False, True), (False, True, True)])
def test_int8_decode_norms_apart_from_large_matrices(monkeypatch, tiny, apart, digits, down):
    """Before an int8 matrix past KERNEL_MAX_WEIGHTS (the 8B shape's qkv and gate/up; here every
    matrix) a decode step's norm goes through add_norm's kernel, which writes the normed row once,
    rather than into each of project's programs (INT8_NORM_APART); with INT8_DIGITS, before
    gate/up also as digits, for the tensor-core kernel, and gate/up's output as digits for down
    (INT8_DOWN_DIGITS). Logits as XLA's every way."""
    tune(monkeypatch, kernel_max_weights=0)
    tune(monkeypatch, int8_norm_apart=apart)
    tune(monkeypatch, int8_digits=digits)
    tune(monkeypatch, int8_down_digits=down)
    tune(monkeypatch, digit_tiles=(16, 32, 4, 3))  # tiles that divide the tiny model
    tune(monkeypatch, down_digit_tiles=(16, 32, 4, 3))
    monkeypatch.setattr(runtime, "multiprocessors", lambda: 4)  # down's 64 rows: 4 programs
    params = quantize_params(tiny("llama").params)
    rows = spy(monkeypatch, "_add_norm_call", lambda x, *a: x.shape[0])
    folded = spy(monkeypatch, "_project_kernel_call", lambda x, w, norm_C, *a: norm_C is not None)
    digit_calls = spy(monkeypatch, "_digits_call", lambda row, w, *a: w.shape)
    runs = decode_per_mode(monkeypatch, params, random_tokens((1, 6), seed=4), 4,
                           ["decode_project", "add_norm"])
    assert rel_err(runs[1], runs[0]) < 1e-5
    # Each kind of block the step traces: qkv, o, gate/up, down; then the lm_head. Two kinds
    # where norms are apart: the first layer's (x from the embedding, its qkv folding the norm)
    # and the rest.
    layer = params.layers[0]
    if apart and digits and down:  # gate/up from digits, and down from gate/up's
        assert folded == [True, False] + [False, False] + [False]
        assert digit_calls == [layer.w_gate_up.shape, layer.w_down.shape] * 2
    elif apart and digits:  # gate/up from digits
        assert folded == [True, False, False] + [False, False, False] + [False]
        assert digit_calls == [layer.w_gate_up.shape] * 2
    elif apart:
        assert folded == [True, False, False, False] + [False] * 4 + [False] and not digit_calls
    else:  # one kind: every qkv and gate/up, and the lm_head, fold their norms
        assert folded == [True, False, True, False] + [True] and rows.count(1) == 0
        assert not digit_calls
    if apart:
        assert rows.count(1) == 2 * 2  # after o and after down in each (the last for the lm_head)


@pytest.mark.slow
@pytest.mark.parametrize("head_digits, prompt", [(True, 4), (True, 1), (False, 4)])
def test_int8_lm_head_from_the_final_norms_digits(monkeypatch, tiny, head_digits, prompt):
    """An int8 lm_head past KERNEL_MAX_INT8_WEIGHTS (XLA's otherwise; here the tiny model's) takes
    the tensor-core kernel from the final add_norm's digits, once a step; the layers' matrices
    (within the limit here) do not. Logits as XLA's either way; JAXLLM_INT8_HEAD_DIGITS=0 keeps
    XLA's product. A one-token prompt's prefill (a fresh step of one row) keeps it too."""
    params = quantize_params(tiny("llama").params)
    head = params.embed if params.lm_head is None else params.lm_head
    tune(monkeypatch, kernel_max_weights=0)
    tune(monkeypatch, kernel_max_int8_weights=math.prod(head.shape) - 1)
    tune(monkeypatch, int8_head_digits=head_digits)
    tune(monkeypatch, head_digit_tiles=(16, 32, 4, 3))  # tiles that divide it
    assert all(math.prod(w.shape) < math.prod(head.shape)
               for w in weight_leaves(params.layers[0]) if isinstance(w, QuantizedWeight))
    digit_calls = spy(monkeypatch, "_digits_call", lambda row, w, *a: w.shape)
    runs = decode_per_mode(monkeypatch, params, random_tokens((1, 6), seed=5), prompt,
                           ["decode_project", "add_norm"])
    assert rel_err(runs[1], runs[0]) < 1e-5
    assert digit_calls == ([head.shape] if head_digits else [])


def test_add_norm_digits_spell_the_normed_row(monkeypatch):
    """add_norm's `DigitRow`: factor * sum_d digits[d] 256^d is the normed row it wrote, exactly
    (bf16 values are exact in the digits' 2^-30 of the largest); a zero row gives zero digits and
    a finite factor; a row with an inf gets a NaN factor, so that its products are NaN."""
    C = 200  # a masked tile of 256
    key = jax.random.key(7)
    x = (jax.random.normal(key, (1, C)) * 3).astype(jnp.bfloat16).at[0, 5].set(900.0)
    g = (1 + jax.random.normal(jax.random.fold_in(key, 1), (C,)) / 4).astype(jnp.bfloat16)
    x = x.at[0, 7].set(1e-6)  # far below the unit 2^(e - 30): truncated, not exact
    _, row = kernels.add_norm(x, jnp.zeros_like(x), g, 1e-5, mode="interpret", digits=True)
    _, normed = kernels.add_norm(x, jnp.zeros_like(x), g, 1e-5, mode="interpret")
    assert isinstance(row, kernels.DigitRow) and row.digits.shape == (kernels.DIGIT_ROWS, C)
    np.testing.assert_array_equal(np.asarray(row.x), np.asarray(normed))
    d = np.asarray(row.digits[:kernels.DIGITS], np.float64)
    assert np.abs(d[:3]).max() <= 128 and np.abs(d[3]).max() <= 64
    spelled = np.sum(d * 256.0 ** np.arange(4)[:, None], axis=0) * float(row.factor[0])
    want = np.asarray(normed[0], np.float64)
    big = np.abs(want) > np.abs(want).max() * 2 ** -20
    np.testing.assert_array_equal(spelled[big], want[big])
    assert np.abs(spelled - want).max() <= np.abs(want).max() * 2 ** -29
    _, zero = kernels.add_norm(jnp.zeros_like(x), jnp.zeros_like(x), g, 1e-5, mode="interpret",
                               digits=True)
    assert not np.asarray(zero.digits[:4]).any() and np.isfinite(float(zero.factor[0]))
    _, bad = kernels.add_norm(x.at[0, 3].set(jnp.inf), jnp.zeros_like(x), g, 1e-5,
                              mode="interpret", digits=True)
    assert np.isnan(float(bad.factor[0]))


@pytest.mark.slow
def test_gate_up_from_digits_equals_xla(monkeypatch):
    """The tensor-core kernel from a `DigitRow` (several chunks and programs) against XLA's
    SwiGLU of the normed row: within a float32 rounding before silu (its int32 sums are exact,
    XLA rounds its own); NaN where the row had an inf. Other matrices ignore the digits, but an
    lm_head past KERNEL_MAX_INT8_WEIGHTS, which takes them without SwiGLU."""
    tune(monkeypatch, kernel_max_weights=0)
    tune(monkeypatch, digit_tiles=(16, 64, 4, 3))
    jax.clear_caches()
    C, F = 256, 96
    key = jax.random.key(11)
    w = quantize(jax.random.normal(key, (2, F, C)))
    x = (jax.random.normal(jax.random.fold_in(key, 1), (1, C)) * 3).at[0, 9].set(-400.0)
    g = jnp.ones((C,), jnp.float32)
    _, row = kernels.add_norm(x, jnp.zeros_like(x), g, 1e-5, mode="interpret", digits=True)
    assert plan.project_digits(w, "interpret", swiglu=True)
    calls = spy(monkeypatch, "_digits_call")
    got = kernels.project(row, w, swiglu=True, mode="interpret")
    want = kernels.project(row.x, w, swiglu=True, mode=None)
    assert len(calls) == 1 and got.shape == want.shape == (1, F)
    assert rel_err(got, want) < 1e-6
    _, bad = kernels.add_norm(x.at[0, 2].set(jnp.inf), jnp.zeros_like(x), g, 1e-5,
                              mode="interpret", digits=True)
    assert np.isnan(np.asarray(kernels.project(bad, w, swiglu=True, mode="interpret"))).all()
    w_o, before = quantize(jax.random.normal(key, (F, C))), len(calls)  # not SwiGLU: of row.x
    assert not plan.project_digits(w_o, "interpret")
    np.testing.assert_array_equal(np.asarray(kernels.project(row, w_o, mode="interpret")),
                                  np.asarray(kernels.project(row.x, w_o, mode="interpret")))
    assert len(calls) == before
    tune(monkeypatch, digit_tiles=(64, 64, 4, 3))  # rows that do not divide F = 96
    assert not plan.project_digits(w, "interpret", swiglu=True)
    # An lm_head past KERNEL_MAX_INT8_WEIGHTS takes it too, in float32 as the logits are.
    tune(monkeypatch, kernel_max_int8_weights=F * C - 1)
    tune(monkeypatch, head_digit_tiles=(16, 64, 4, 3))
    assert plan.project_digits(w_o, "interpret") and not plan.project_digits(w_o, None)
    assert not plan.project_digits(w_o, "interpret", biased=True)
    got = kernels.project(row, w_o, mode="interpret", out_dtype=jnp.float32)
    assert len(calls) == before + 1 and got.dtype == jnp.float32
    assert rel_err(got, kernels.project(row.x, w_o, out_dtype=jnp.float32)) < 1e-6
    assert np.isnan(np.asarray(kernels.project(bad, w_o, mode="interpret"))).all()
    tune(monkeypatch, head_digit_tiles=(64, 64, 4, 3))  # rows that do not divide 96
    assert not plan.project_digits(w_o, "interpret")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_down_from_gate_ups_digits_equals_xla(monkeypatch, dtype):
    """gate/up's kernel writes its output also as five digits in the unit that `down_bounds`
    times the row's squared sum of magnitudes sets (the bound holds); they spell the output to
    2^-24 of its largest value, its values far above the unit exactly; down's tensor-core kernel
    from them is XLA's product of that output within a float32 rounding. A row with an inf: NaN."""
    C, F, D = 64, 96, 48
    tune(monkeypatch, kernel_max_weights=0)
    tune(monkeypatch, digit_tiles=(16, 32, 4, 3))
    tune(monkeypatch, down_digit_tiles=(16, 32, 4, 3))
    monkeypatch.setattr(runtime, "multiprocessors", lambda: 4)  # down's 48 rows: 3 programs
    key = jax.random.key(13)
    r = lambda i, shape: jax.random.normal(jax.random.fold_in(key, i), shape)
    w_gate_up, w_down = quantize(r(0, (2, F, C)), dtype=dtype), quantize(r(1, (D, F)), dtype=dtype)
    x = (r(2, (1, C)) * 3).at[0, 5].set(-60.0).astype(dtype)
    g = (1 + r(3, (C,)) / 4).astype(dtype)
    _, row = kernels.add_norm(x, jnp.zeros_like(x), g, 1e-5, mode="interpret", digits=True)
    np.testing.assert_allclose(float(row.l1[0]), np.abs(np.asarray(row.x, np.float64)).sum(),
                               rtol=1e-6)
    assert plan.project_digits(w_gate_up, "interpret", swiglu=True)
    assert plan.down_digits(w_down, "interpret") and not plan.down_digits(w_down, None)
    bounds = kernels.down_bounds([w_gate_up, w_gate_up])
    act = kernels.project(row, w_gate_up, swiglu=True, mode="interpret", down_digits_of=(bounds, 1))
    plain = kernels.project(row, w_gate_up, swiglu=True, mode="interpret")
    assert isinstance(act, kernels.DigitRow) and act.count == kernels.DOWN_DIGITS == 5
    np.testing.assert_array_equal(np.asarray(act.x), np.asarray(plain))
    values = np.asarray(act.x, np.float64)[0]
    bound = float(bounds[1]) * float(row.l1[0]) ** 2
    assert np.abs(values).max() <= bound
    d = np.asarray(act.digits[:5], np.float64)
    assert np.abs(d[:4]).max() <= 128 and np.abs(d[4]).max() <= 65
    spelled = np.sum(d * 256.0 ** np.arange(5)[:, None], axis=0) * float(act.factor[0])
    largest = np.abs(values).max()
    assert np.abs(spelled - values).max() <= largest * 2 ** -24
    big = np.abs(values) > float(act.factor[0]) * 2 ** 24
    assert big.any()
    np.testing.assert_array_equal(spelled[big], values[big])
    calls = spy(monkeypatch, "_digits_call", lambda row, w, *a: w.shape)
    got = kernels.project(act, w_down, mode="interpret")
    assert calls == [w_down.shape] and got.dtype == dtype
    assert rel_err(got, kernels.project(act.x, w_down)) < (1e-6 if dtype == jnp.float32 else 1e-2)
    _, bad = kernels.add_norm(x.at[0, 2].set(jnp.inf), jnp.zeros_like(x), g, 1e-5,
                              mode="interpret", digits=True)
    act = kernels.project(bad, w_gate_up, swiglu=True, mode="interpret", down_digits_of=(bounds, 0))
    assert np.isnan(np.asarray(kernels.project(act, w_down, mode="interpret"))).all()
    monkeypatch.setattr(runtime, "multiprocessors", lambda: 5)  # 3 programs: too few for 5
    assert not plan.down_digits(w_down, "interpret")
    monkeypatch.setattr(runtime, "multiprocessors", lambda: 4)
    tune(monkeypatch, int8_down_digits=False)
    assert not plan.down_digits(w_down, "interpret")


@pytest.mark.slow
@pytest.mark.parametrize("dtype, C, M, rows", [(jnp.float32, 80, 5, 1), (jnp.float32, 64, 5, 1),
                                                (jnp.bfloat16, 80, 5, 1), (jnp.float32, 80, 12, 4)])
def test_add_norm_kernel_equals_xla(monkeypatch, dtype, C, M, rows):
    """The residual sum exactly (one rounding, as XLA's add), the normed sum to the dtype's last
    bit at most: C = 80 is a masked tile of 128, 64 a whole one; rows: a program's rows."""
    tune(monkeypatch, add_norm_rows=rows)
    jax.clear_caches()  # read when the kernel traces
    key = jax.random.key(C)
    r = lambda i, shape: jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)
    x, delta, g = (r(0, (M, C)) * 3).astype(dtype), r(1, (M, C)).astype(dtype), 1 + r(2, (C,)) / 4
    g = g.astype(dtype)
    total, normed = kernels.add_norm(x, delta, g, 1e-5, mode="interpret")
    ref_total, ref_normed = kernels.add_norm(x, delta, g, 1e-5, mode=None)
    assert total.dtype == ref_total.dtype == normed.dtype == ref_normed.dtype == dtype
    np.testing.assert_array_equal(np.asarray(total), np.asarray(ref_total))
    tol = 1e-6 if dtype == jnp.float32 else 2 ** -7  # bf16: a one-ulp rounding flip at most
    assert rel_err(np.asarray(normed, np.float32), np.asarray(ref_normed, np.float32)) < tol


@pytest.mark.parametrize("dtype, C, M, offset, post", [
    (jnp.float32, 64, 5, 0.0, False),  # one row of 64, padded to 8 in shared memory
    (jnp.bfloat16, 576, 1, 0.0, False),  # SmolLM2's width: 9 rows of 64, padded to 16
    (jnp.bfloat16, 1152, 3, 1.0, True),  # Gemma's: norms by (1 + w), the delta normed first
])
def test_add_norm_on_mosaic_gpu_equals_xla(monkeypatch, mosaic_interpreter, dtype, C, M, offset, post):
    """add_norm's Mosaic GPU form (JAXLLM_ADD_NORM_BACKEND=mosaic_gpu), in Mosaic GPU's
    interpreter: the residual sum exactly, the normed sum to the dtype's last bit at most, as
    the Triton kernel's test asks; a program a row."""
    tune(monkeypatch, add_norm_backend="mosaic_gpu")
    calls = spy(monkeypatch, "_mosaic_add_norm_call", lambda x, *a: x.shape)
    key = jax.random.key(C)
    r = lambda i, shape: jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)
    x, delta = (r(0, (M, C)) * 3).astype(dtype), r(1, (M, C)).astype(dtype)
    g, pg = ((1 + r(i, (C,)) / 4).astype(dtype) for i in (2, 3))
    pg = pg if post else None
    total, normed = kernels.add_norm(x, delta, g, 1e-5, offset=offset, delta_norm_C=pg, mode="interpret")
    ref_total, ref_normed = kernels.add_norm(x, delta, g, 1e-5, offset=offset, delta_norm_C=pg, mode=None)
    assert calls == [(M, C)]
    assert total.dtype == ref_total.dtype and normed.dtype == ref_normed.dtype
    np.testing.assert_array_equal(np.asarray(total), np.asarray(ref_total))
    tol = 1e-6 if dtype == jnp.float32 else 2 ** -7
    assert rel_err(np.asarray(normed, np.float32), np.asarray(ref_normed, np.float32)) < tol


def test_add_norm_on_mosaic_gpu_leaves_what_it_cannot_take_to_the_triton_kernel(monkeypatch):
    """Widths not whole rows of 64, norm weights of another dtype and digit rows take the Triton
    kernel under the Mosaic GPU backend."""
    tune(monkeypatch, add_norm_backend="mosaic_gpu")
    mosaic, triton = spy(monkeypatch, "_mosaic_add_norm_call"), spy(monkeypatch, "_add_norm_call")
    x = jnp.ones((1, 80), jnp.bfloat16)
    kernels.add_norm(x, x, jnp.ones((80,), jnp.bfloat16), 1e-5, mode="interpret")
    x = jnp.ones((1, 64), jnp.bfloat16)
    kernels.add_norm(x, x, jnp.ones((64,), jnp.float32), 1e-5, mode="interpret")
    kernels.add_norm(x, x, jnp.ones((64,), jnp.bfloat16), 1e-5, mode="interpret", digits=True)
    assert (len(mosaic), len(triton)) == (0, 3)


@pytest.mark.slow
def test_decode_through_add_norm_on_mosaic_gpu_matches_the_full_forward(monkeypatch, mosaic_interpreter, tiny):
    """A tiny model's prefill and decode steps with every residual add + norm on the Mosaic GPU
    form (in its interpreter) give the full forward's logits."""
    m = tiny("qwen3")
    tune(monkeypatch, add_norm_backend="mosaic_gpu")
    calls = spy(monkeypatch, "_mosaic_add_norm_call")
    _decode_matches_forward(m, kernels_on=lambda: _interpreted_within("add_norm"))
    assert len(calls) == 2 * m.params.config.num_layers - 1  # the prefill traced: 2 a layer, the last 1
    with _interpreted_within("add_norm"):
        paths = plan.describe(plan.step_plan(m.params, 2, 8, fresh=True))
    assert (paths["add_norm"], paths["mosaic_gpu"]) == ("kernel", "add_norm")


def test_add_norm_mode_rules(monkeypatch):
    assert tuning().add_norm == "auto"
    assert plan.add_norm_mode(jnp.float32) is None
    assert plan.add_norm_mode(jnp.bfloat16) is None  # no GPU here
    tune(monkeypatch, add_norm="interpret")
    assert plan.add_norm_mode(jnp.float32) == "interpret"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama_bias", "qwen3", "qwen2_swa"])
def test_prefill_through_add_norm_matches_the_full_forward(monkeypatch, tiny, name):
    """The prefill pairs its residual adds with the next norm in the kernel, and the decode steps
    after it (on XLA) read the cache it wrote; the reference forward runs on XLA."""
    m = tiny(name)
    calls = spy(monkeypatch, "_add_norm_call")
    _decode_matches_forward(m, kernels_on=lambda: _interpreted_within("add_norm"))
    layers = m.params.config.num_layers
    assert len(calls) == 2 * layers - 1  # the prefill traced: 2 a layer, the last layer 1


@pytest.mark.slow
@pytest.mark.parametrize("name, limit, decode_calls", [
    ("llama_bias", 8191, 4),  # qkv and gate/up on XLA: o and down add and norm in the kernel
    ("qwen3", 12288, 2),  # gate/up in project's kernel (norm folded in), qkv on XLA after down
])  # and the final norm, before a lm_head of VOCAB x 64 > limit
def test_batch_1_decode_through_add_norm_matches_the_full_forward(monkeypatch, project_mode, tiny,
                                                                   name, limit, decode_calls):
    """At batch 1 a residual add and the norm after it share `add_norm`'s kernel where the matrix
    the norm feeds is too large for `project`'s kernel; `limit` makes some of the tiny ones so."""
    tune(monkeypatch, kernel_max_weights=limit)
    rows = spy(monkeypatch, "_add_norm_call", lambda x, *a: x.shape[0])
    _decode_matches_forward(tiny(name), rows=1, kernels_on=lambda: _interpreted_within("add_norm"))
    assert rows.count(1) == decode_calls  # the decode step traced (the prefill's rows are 8)


def _rows_cases(M):
    """(name, x, w, keywords) of each form `rows_project` takes in a decode layer of M rows."""
    key = jax.random.key(M)
    r = lambda i, shape: jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)
    C, N, F = 96, 48, 32  # C in chunks of 32 (three), N in programs of 16 outputs
    x, g, b, res = r(0, (M, C)), 1 + r(1, (C,)) / 4, r(2, (N,)), r(3, (M, N))
    w, w_gate_up = r(4, (N, C)) / 8, r(5, (2, F, C)) / 8
    return [("norm + qkv + bias", x, w, dict(norm_C=g, eps=1e-5, bias_N=b)),
            ("o + bias + residual", x, w, dict(bias_N=b, residual_MN=res)),
            ("norm + gate/up + swiglu", x, w_gate_up, dict(norm_C=g, swiglu=True)),
            ("down + residual", x, w, dict(residual_MN=res))]


@pytest.mark.slow
@pytest.mark.parametrize("M", [3, 16, 32])  # rows padded to 16, masked; and ROWS_MAX
def test_rows_project_equals_xla(M):
    for name, x, w, kw in _rows_cases(M):
        assert rows_module.supports(w, kw.get("swiglu", False)), name
        out = kernels.rows_project(x, w, mode="interpret", **kw)
        ref = kernels.rows_project(x, w, mode=None, **kw)  # XLA's form
        assert out.shape == ref.shape and out.dtype == ref.dtype, name
        assert rel_err(np.asarray(out), np.asarray(ref)) < 1e-5, name


def test_rows_project_rules(monkeypatch):
    assert tuning().rows_project == "auto"
    assert plan.rows_project_mode(jnp.bfloat16, 32) is None  # no GPU here
    tune(monkeypatch, rows_project="interpret")
    assert plan.rows_project_mode(jnp.float32, tuning().rows_min) == "interpret"
    assert plan.rows_project_mode(jnp.float32, tuning().rows_max) == "interpret"
    assert plan.rows_project_mode(jnp.float32, 1) is None  # one row: `project`'s kernel
    assert plan.rows_project_mode(jnp.float32, 7) is None  # below ROWS_MIN: XLA's GEMM
    assert plan.rows_project_mode(jnp.float32, 8) == "interpret"  # padded to 16
    assert plan.rows_project_mode(jnp.float32, tuning().rows_max + 1) is None
    # more rows than the tiles fit: XLA's form, whatever the caller's mode
    calls = spy(monkeypatch, "_rows_call")
    kernels.rows_project(jnp.ones((tuning().rows_max + 1, 96)), jnp.ones((64, 96)), mode="interpret")
    assert not calls
    w = jnp.ones((64, 96))
    assert rows_module.supports(w)
    kernels.rows_project(jnp.ones((8, 96)), w, mode=None)  # no mode: XLA's form
    assert not calls
    assert not rows_module.supports(quantize(w))  # int8: XLA's GEMM converts it
    assert not rows_module.supports(jnp.ones((64, 72)))  # no chunk of 16 divides 72
    assert not rows_module.supports(jnp.ones((40, 96)))  # nor 16 outputs 40
    # the 8B shape's tiles: 64 outputs where they fill 2/3 of the multiprocessors, else 32
    monkeypatch.setattr(runtime, "multiprocessors", lambda: 132)
    assert rows_module.rows_tiles(6144, 4096)[:2] == (64, 128)  # qkv: 96 programs
    assert rows_module.rows_tiles(4096, 14336)[:2] == (32, 256)  # down: 128 programs
    # below 32 rows only matrices of the 8B shape's size (smaller models' steps lost there)
    eight_b = [(6144, 4096), (4096, 4096), (14336, 4096), (4096, 14336)]
    one_b = [(3072, 2048), (2048, 2048), (8192, 2048), (2048, 8192)]
    assert plan.rows_sized(16, eight_b) and plan.rows_sized(8, eight_b)
    assert not plan.rows_sized(16, one_b) and not plan.rows_sized(31, one_b)
    assert plan.rows_sized(32, one_b)


def test_rows_kernel_signals_dependents_only_from_32_padded_rows(monkeypatch):
    """The PDL signal (griddepcontrol.launch_dependents) in the kernel as lowered for a Hopper
    GPU: at 17-32 rows, not at 16 or fewer (where the 8B shape's steps lost with it)."""
    monkeypatch.setattr(runtime, "gpu_generation", lambda: 9)
    w = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)
    for M, signals in [(8, False), (16, False), (17, True), (32, True)]:
        x = jax.ShapeDtypeStruct((M, 256), jnp.bfloat16)
        call = jax.jit(lambda x, w: rows_module._rows_call(x, w, swiglu=False, tiles=(16, 64, 4, 5),
                                                       interpret=False, tuning=tuning()))
        text = call.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
        assert ("griddepcontrol.launch_dependents" in text) == signals, M


@pytest.mark.slow
@pytest.mark.parametrize("name, attention", [("llama", False), ("qwen2_swa", True),
                                             ("qwen3", True), ("llama_tied", False)])
def test_rows_decode_matches_the_full_forward(monkeypatch, tiny, name, attention):
    """A decode step of several rows (two here, ROWS_MIN lowered) runs every matrix through
    `rows_project`'s kernel, down adding the residual, and o's output with the residual through
    `add_norm`'s kernel (the FFN's normed input); logits as the full forward's."""
    m = tiny(name)
    tune(monkeypatch, rows_min=2)
    tune(monkeypatch, rows_large_weights=0)  # the tiny matrices count as large
    tune(monkeypatch, add_norm="interpret")
    if attention:  # with the attention kernel too (qwen2_swa: biases and a window)
        tune(monkeypatch, decode_attention="interpret")
    calls = spy(monkeypatch, "_rows_call", lambda x, w, bias, residual: residual is not None)
    norms = spy(monkeypatch, "_add_norm_call", lambda x, *a: x.shape[0])
    _decode_matches_forward(m, kernels_on=lambda: _interpreted_within("rows_project"))
    # qkv, o, gate/up, down; the layers trace once per attention window (qwen2_swa: two kinds)
    cfg = m.params.config
    windows = {cfg.sliding_window if cfg.is_sliding(i) else None for i in range(cfg.num_layers)}
    assert calls == [False, False, False, True] * len(windows)
    assert norms.count(2) == len(windows)  # the decode steps' (the prefill's have 16 rows)


def _rows_mode(params, B: int, T: int, fresh: bool = False) -> str | None:
    """The rows family's mode in the step plan of B rows of T tokens, None where it takes another."""
    how = plan.step_plan(params, B, T, fresh=fresh).layers[0].projection
    return how.mode if how.family == "rows" else None


def test_rows_decode_leaves_prefills_and_int8_to_xla(monkeypatch, tiny):
    tune(monkeypatch, rows_project="interpret")
    assert _rows_mode(tiny("llama").params, 32, 1) == "interpret"
    assert _rows_mode(tiny("llama").params, 32, 3) is None  # a prefill
    assert _rows_mode(tiny("llama").params, 32, 1, fresh=True) is None
    assert _rows_mode(quantize_params(tiny("llama").params), 32, 1) is None
    # 8-31 rows: only models whose every matrix is large
    assert _rows_mode(tiny("llama").params, 16, 1) is None
    tune(monkeypatch, rows_large_weights=64 * 64 + 1)  # o has 64 x 64, the rest more
    assert _rows_mode(tiny("llama").params, 16, 1) is None
    tune(monkeypatch, rows_large_weights=0)
    assert _rows_mode(tiny("llama").params, 16, 1) == "interpret"


def test_step_plan_names_each_paths_kernels_and_is_a_static_argument(monkeypatch, tiny):
    """One host-side plan per (params, rows, tokens per row): one row takes `project`'s kernels,
    8-32 rows the rows kernels, a prefill (past verify_tokens) neither; it is hashable (a jit
    static argument), and layers of one shape share one layer plan (they trace once)."""
    params = tiny("llama").params
    tune(monkeypatch, decode_project="interpret", rows_project="interpret", add_norm="interpret",
         decode_attention="interpret")
    one, rows, prefill = (plan.step_plan(params, B, T, cache_length=32) for B, T in ((1, 1), (32, 1), (2, 16)))
    assert {lp.projection.family for lp in one.layers} == {"project"} and one.head.family == "project"
    assert {lp.projection.family for lp in rows.layers} == {"rows"} and rows.head.family is None
    assert {lp.projection.family for lp in prefill.layers} == {None} and prefill.attention is None
    assert one.attention == rows.attention == "interpret"
    assert hash(one) == hash(plan.step_plan(params, 1, 1, cache_length=32)) and one != rows
    assert len(set(one.layers[:-1])) == 1  # the last layer differs only in what comes next
    assert jax.jit(lambda x, p: x + len(p.layers), static_argnums=1)(1, one) == 1 + len(one.layers)


def test_gemmas_epilogues_equal_xla():
    """GeGLU's tanh GELU in gate/up's kernels (one row, 16 rows, float and int8 weights), against
    `layers.mlp`'s arithmetic in float32; the activation matters (silu's sums differ)."""
    for M, call in [(1, kernels.project), (16, kernels.rows_project)]:
        cases = _project_cases(M) if M == 1 else _rows_cases(M)
        for name, x, w, kw in [c for c in cases if c[3].get("swiglu")]:
            kw = dict(kw, activation="gelu_tanh")
            out = call(x, w, mode="interpret", **kw)
            normed = L.rms_norm(x, kw["norm_C"], 1e-6)
            y = L.project(normed, w)
            ref = L.ACTIVATION["gelu_tanh"](y[:, 0]) * y[:, 1]
            assert rel_err(np.asarray(out), np.asarray(ref)) < 1e-5, (M, name)
            silu = call(x, w, mode="interpret", **dict(kw, activation="silu"))
            assert rel_err(np.asarray(silu), np.asarray(ref)) > 1e-2, (M, name)


@pytest.mark.parametrize("dtype, M", [(jnp.float32, 1), (jnp.float32, 5), (jnp.bfloat16, 1)])
def test_add_norm_takes_gemmas_offset_and_post_norm(dtype, M):
    """add_norm with (1 + w) norms, and with the delta through its own norm first (Gemma's
    post-norms), against `layers.rms_norm`'s arithmetic: the sum exactly in float32 (one
    rounding of the normed delta, then the add), the normed sum to float32's precision (bf16:
    one last-bit flip)."""
    key = jax.random.key(M)
    r = lambda i, shape: jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)
    C = 80  # a masked tile of 128
    x, delta = (r(0, (M, C)) * 3).astype(dtype), r(1, (M, C)).astype(dtype)
    g, post = (r(i, (C,)) / 4 for i in (2, 3))  # (1 + w): weights about 0
    g, post = g.astype(dtype), post.astype(dtype)
    tol = 1e-6 if dtype == jnp.float32 else 2 ** -7
    for delta_norm in (None, post):
        total, normed = kernels.add_norm(x, delta, g, 1e-5, offset=1.0, delta_norm_C=delta_norm,
                                         mode="interpret")
        d = delta if delta_norm is None else L.rms_norm(delta, delta_norm, 1e-5, 1.0)
        ref_total = x + d
        ref_normed = L.rms_norm(ref_total, g, 1e-5, 1.0)
        assert total.dtype == normed.dtype == dtype
        if dtype == jnp.float32:
            assert rel_err(np.asarray(total), np.asarray(ref_total)) < 1e-6
        else:
            assert rel_err(np.asarray(total, np.float32), np.asarray(ref_total, np.float32)) < tol
        assert rel_err(np.asarray(normed, np.float32), np.asarray(ref_normed, np.float32)) < tol
        xla = kernels.add_norm(x, delta, g, 1e-5, offset=1.0, delta_norm_C=delta_norm, mode=None)
        np.testing.assert_array_equal(np.asarray(xla[0]), np.asarray(ref_total))
    plain = kernels.add_norm(x, delta, g, 1e-5, mode="interpret")[1]  # the offset matters
    assert rel_err(np.asarray(plain, np.float32), np.asarray(normed, np.float32)) > 0.1
