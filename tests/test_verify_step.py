"""Verify steps (2-9 new tokens a row on a warm cache, `step(..., all_logits=True)`) through the
decode kernels' few-token forms: the plan's rules, every position's logits and the cache against
XLA's prefill form in float32 (kernels in Pallas' interpreter), and speculative decoding through
them still token for token plain greedy decoding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxllm
from jaxllm import kernels
from jaxllm.engine.speculative import Draft
from jaxllm.kernels.decode_attention import supports as attention_supports
from jaxllm.model import plan
from jaxllm.model import transformer as model
from jaxllm.model.cache import init_cache, rollback
from jaxllm.model.params import quantize_params
from kernel_modes import spy, tune
from tiny_models import random_tokens, rel_err

SWITCHES = dict(decode_attention="interpret", rows_project="interpret", add_norm="interpret")


def _families(p: plan.StepPlan):
    return {lp.projection.family for lp in p.layers}


def test_plan_takes_the_few_token_kernels_for_2_to_9_tokens_on_a_warm_cache(monkeypatch, tiny):
    params = tiny("llama").params
    tune(monkeypatch, rows_large_weights=0, **SWITCHES)
    for T in range(2, 10):
        p = plan.step_plan(params, 4, T, cache_length=64)
        assert p.attention == "interpret" and p.layers[0].attention == "interpret", T
        # 4 rows of T tokens are 8..36 rows: the rows kernels up to rows_max (32)
        assert _families(p) == ({"rows"} if 4 * T <= 32 else {None}), T
        assert p.head.family is None  # every position's logits: XLA's lm_head, as a prefill's
    assert plan.step_plan(params, 4, 5, cache_length=64, fresh=True).attention is None  # a prefill
    assert _families(plan.step_plan(params, 4, 5, cache_length=64, fresh=True)) == {None}
    assert plan.step_plan(params, 4, 10, cache_length=64).attention is None  # past verify_tokens
    assert plan.step_plan(params, 4, 5, cache_length=64, kv_int8=True).attention is None
    assert plan.step_plan(params, 4, 5).attention is None  # no cache length: XLA's attention
    assert _families(plan.step_plan(quantize_params(params), 4, 5, cache_length=64)) == {None}
    # from verify_rows_min (2) tokens in all, the rows kernels; below it XLA's matrices (the
    # attention kernel still)
    assert _families(plan.step_plan(params, 1, 2, cache_length=64)) == {"rows"}
    tune(monkeypatch, verify_rows_min=6)
    few = plan.step_plan(params, 1, 5, cache_length=64)
    assert _families(few) == {None} and few.attention == "interpret"
    tune(monkeypatch, verify_tokens=0)  # the switch off: XLA's prefill forms, as before
    off = plan.step_plan(params, 4, 5, cache_length=64)
    assert off.attention is None and _families(off) == {None}


def test_auto_mode_keeps_float32_and_cpu_verify_steps_on_xla(tiny):
    params = tiny("llama").params
    p = plan.step_plan(params, 4, 5, cache_length=64)
    assert p.attention is None and _families(p) == {None}


def test_attention_kernel_takes_at_most_128_query_rows_a_program():
    # T tokens and G queries each, both to powers of two: 16 x 8 = 128 rows, 16 x 16 too many
    assert attention_supports(128, 128, False, 384, True, tokens=9, q_per_kv=8)
    assert not attention_supports(128, 128, False, 384, True, tokens=9, q_per_kv=9)
    assert attention_supports(128, 128, False, 384, True, tokens=8, q_per_kv=16)
    assert attention_supports(128, 128, False, 384, True, q_per_kv=64)  # one token: no such limit
    # heads of 256 (Gemma's): 64 rows, so the float32 sums fit as 128 rows of 128 do
    assert attention_supports(256, 256, False, 384, True, tokens=9, q_per_kv=4)  # 16 x 4
    assert not attention_supports(256, 256, False, 384, True, tokens=9, q_per_kv=8)  # 16 x 8
    assert attention_supports(256, 256, False, 384, True, tokens=8, q_per_kv=8)  # 8 x 8


def _verify_step(params, T: int, cache_length: int = 32):
    """A ragged batch (row 1 left-padded, rows rolled back to ends 32-T, 30-T, 27-T) then one
    verify step of T tokens: (logits [3, T, V], the cache after it)."""
    ids = random_tokens((3, cache_length - T), seed=T)
    ids[1, :3] = params.config.pad_id
    cache = init_cache(params.config, 3, cache_length, jnp.float32, start=jnp.asarray([0, 3, 0]))
    _, cache = model.step(params, jnp.asarray(ids), cache, fresh=True)
    cache = rollback(cache, jnp.asarray([0, 2, 5]))  # stale slots past each end stay, unseen
    step = jax.jit(model.step, static_argnames=("fresh", "all_logits"))
    return step(params, jnp.asarray(random_tokens((3, T), seed=100 + T)), cache, all_logits=True)


@pytest.mark.parametrize("name, T, rows_min", [("llama", 5, 2),
                                               ("gemma2", 4, 2)])  # soft-capped scores, windows of 4
def test_verify_step_through_the_kernels_equals_xla(monkeypatch, tiny, name, T, rows_min):
    _check_verify_step(monkeypatch, tiny(name).params, T, rows_min)


@pytest.mark.slow
@pytest.mark.parametrize("name, T, rows_min", [
    ("qwen3", 8, 2),  # q/k norms, a tied lm_head; the first row ends at the cache's end
    ("qwen2_swa", 6, 2),  # biases; windows of 4, shorter than T
    ("mistral", 9, 2),  # a window of 4 over 9 new tokens
    ("llama_tied", 2, 8),  # 6 rows: XLA's matrices, the attention kernel
    ("llama", 3, 8),  # 9 rows: the rows kernels from rows_min
    ("gemma3", 4, 2),  # two ropes, (1 + w) q/k norms, GeGLU, post-norms; windows of 4
])
def test_verify_step_of_each_family_through_the_kernels_equals_xla(monkeypatch, tiny, name, T,
                                                                   rows_min):
    _check_verify_step(monkeypatch, tiny(name).params, T, rows_min)


def _check_verify_step(monkeypatch, params, T: int, rows_min: int):
    """Every position's logits and every layer's cache after a verify step through the kernels
    (interpreted) equal XLA's prefill form's, in float32; the plan took the kernels it says."""
    want_logits, want = _verify_step(params, T)
    tune(monkeypatch, rows_large_weights=0, verify_rows_min=rows_min, **SWITCHES)
    attended = spy(monkeypatch, "verify_attention", lambda qkv, *a: qkv.shape[1], module=kernels)
    rows = spy(monkeypatch, "_rows_call", lambda x, *a: x.shape[0])
    logits, cache = _verify_step(params, T)
    assert attended and set(attended) == {T}  # traced once a kind of layer
    assert set(rows) == ({3 * T} if 3 * T >= rows_min else set())
    assert logits.shape == want_logits.shape == (3, T, params.config.vocab_size)
    assert rel_err(np.asarray(logits), np.asarray(want_logits)) < 1e-5
    np.testing.assert_array_equal(np.asarray(cache.end), np.asarray(want.end))
    for got, ref in zip(cache.k + cache.v, want.k + want.v):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5)
    jax.clear_caches()


def _prompts(seed=0):
    """A ragged batch with repeats inside each prompt, so prompt lookup finds matches."""
    return [random_tokens(n, seed=seed + n).tolist() * 2 for n in (3, 7, 5)]


@pytest.mark.slow
@pytest.mark.parametrize("name, k", [("llama", 3), ("qwen2_swa", 7), ("gemma3", 3)])
def test_speculative_greedy_through_the_kernels_equals_plain_greedy(monkeypatch, tiny, name, k):
    """generate with prompt lookup and with the target as its own draft, every step through the
    kernels (verify steps of 3 rows of k + 1 tokens: the rows kernels and verify_attention),
    gives plain greedy decoding's tokens (XLA's)."""
    params = tiny(name).params
    plain = jaxllm.generate(params, _prompts(), max_new_tokens=20, eos_token_ids=[])
    tune(monkeypatch, rows_large_weights=0, **SWITCHES)
    attended = spy(monkeypatch, "verify_attention", lambda qkv, *a: qkv.shape[1], module=kernels)
    for proposer in ("ngram", params):
        out = jaxllm.generate(params, _prompts(), max_new_tokens=20, eos_token_ids=[],
                              speculative=proposer, num_speculative=k)
        np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(plain.lengths))
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(plain.tokens))
        # the target as its own draft verifies every round; prompt lookup needs its two-token
        # matches, which a tiny random model's output may never give after the prompt
        assert out.stats.verify_rounds > 0 or proposer == "ngram"
    # the verify steps' k + 1 tokens, and the draft's catch-up chunks and first steps of two
    # tokens (its cache is in whole blocks, so they take the kernel too)
    assert attended and set(attended) == {k + 1, Draft.chunk, 2}
    jax.clear_caches()
