"""Per-row cache state: rows that end at different slots, a prefilled request inserted into a
running batch, rows rolled back after rejected tokens, rows released and reused, and a step that
returns the logits of every new position. Each against a fresh run of the same tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxllm
from jaxllm.model.cache import init_cache, insert, release, rollback
from jaxllm.engine.generate import pad_prompts
from jaxllm.model.transformer import jitted_step
from kernel_modes import tune
from tiny_models import random_tokens, rel_err

# (decode attention, kv_dtype): XLA's form, the Pallas kernel interpreted, the int8 cache.
MODES = [("xla", None), ("interpret", None), ("xla", "int8")]


@pytest.fixture(params=MODES, ids=["xla", "kernel", "int8"])
def mode(request, monkeypatch):
    """The kv_dtype of a test's caches, decode steps taking the attention the mode names."""
    attention, kv_dtype = request.param
    tune(monkeypatch, decode_attention=attention)
    yield kv_dtype
    jax.clear_caches()


def _greedy(logits_BV) -> np.ndarray:
    return np.argmax(np.asarray(logits_BV), axis=-1).astype(np.int32)


def _running_batch(params, prompts, length: int, kv_dtype=None):
    """A cache of len(prompts) left-padded rows after their prefill, and the prefill's logits."""
    tokens, start, _ = pad_prompts(params, [p.tolist() for p in prompts])
    cache = init_cache(params.config, len(prompts), length, params.dtype, start=start, kv_dtype=kv_dtype)
    return jaxllm.prefill(params, tokens, cache)


def _prefix(params, prompt, length: int = 16, kv_dtype=None):
    """(logits [1, V], one-row cache) of `prompt` prefilled alone into `length` slots."""
    cache = init_cache(params.config, 1, length, params.dtype, kv_dtype=kv_dtype)
    return jaxllm.prefill(params, prompt[None], cache)


def _decode(params, cache, token_B, steps: int):
    """Greedy: (tokens [steps, B] fed after token_B, logits [steps, B, V], cache)."""
    tokens, logits = [], []
    for _ in range(steps):
        logits_BV, cache = jaxllm.decode_step(params, token_B, cache)
        token_B = _greedy(logits_BV)
        tokens.append(token_B)
        logits.append(np.asarray(logits_BV))
    return np.stack(tokens), np.stack(logits), cache


def test_an_inserted_request_decodes_as_it_would_alone(tiny, mode):
    """A prompt prefilled alone and inserted into row 1 of a batch that is mid-decode: that row's
    greedy tokens are `generate`'s for the prompt, and the other rows' are what they were."""
    m = tiny("mistral")  # a 4-token window: the row's window bounds follow its own end
    params = m.params
    prompts = [random_tokens(n, seed=40 + n) for n in (5, 11, 8)]
    logits, cache = _running_batch(params, prompts, 48, mode)
    decoded, _, cache = _decode(params, cache, _greedy(logits), 3)
    token_B = decoded[-1]
    plain_tokens, _, _ = _decode(params, cache, token_B, 8)  # (a CPU cache is not donated)

    prompt = random_tokens(6, seed=7)
    first, prefix = _prefix(params, prompt, kv_dtype=mode)
    put = jax.jit(insert)
    cache = put(cache, prefix, jnp.int32(1))
    assert np.asarray(cache.end)[1] == 6 and np.asarray(cache.start)[1] == 0
    token_B = token_B.copy()
    token_B[1] = _greedy(first)[0]
    tokens, _, _ = _decode(params, cache, token_B, 8)

    alone = jaxllm.generate(params, [prompt.tolist()], max_new_tokens=9, eos_token_ids=[], kv_dtype=mode)
    np.testing.assert_array_equal(np.concatenate([[token_B[1]], tokens[:, 1]]), alone.tokens[0])
    np.testing.assert_array_equal(tokens[:, [0, 2]], plain_tokens[:, [0, 2]])
    # The row is traced: inserting into another row runs the same compiled program.
    put(cache, prefix, jnp.int32(2))
    assert put._cache_size() == 1


def test_a_rolled_back_row_decodes_as_the_shorter_row(tiny, mode):
    """Rows take 3 tokens that are then rejected, row 0 all of them, row 1 the last 2: the tokens
    that follow get the logits of a fresh forward over what each row kept, and the kept slots
    hold what decoding the kept tokens alone writes."""
    m = tiny("qwen3")  # per-head q/k norms
    params = m.params
    prompts = [random_tokens(n, seed=50 + n) for n in (9, 4)]
    fed = random_tokens((2, 12), seed=3)  # 4 accepted, 3 on trial, then 5 more
    logits, cache = _running_batch(params, prompts, 32, mode)
    steps = [np.asarray(logits)]
    for t in range(7):
        logits, cache = jaxllm.decode_step(params, fed[:, t], cache)
        steps.append(np.asarray(logits))
    ends = np.asarray(cache.end)
    cache = rollback(cache, jnp.asarray([3, 2], jnp.int32))
    np.testing.assert_array_equal(np.asarray(cache.end), ends - [3, 2])
    steps = steps[:5]
    for t in range(7, 12):
        logits, cache = jaxllm.decode_step(params, fed[:, t], cache)
        steps.append(np.asarray(logits))
    got_BTV = np.stack(steps, axis=1)
    kept = [np.concatenate([prompts[0], fed[0, :4], fed[0, 7:]]),
            np.concatenate([prompts[1], fed[1, :5], fed[1, 7:]])]
    tol = 5e-2 if mode else 1e-4  # the int8 cache is close to the float forward, not equal
    for b, row in enumerate(kept):
        full = np.asarray(jaxllm.forward(params, row[None]))[0, len(prompts[b]) - 1:]
        ref = np.concatenate([full[:5], full[-5:]])  # the prefill, 4 accepted, then 5 after the rollback
        assert rel_err(got_BTV[b], ref) < tol, f"row {b}"
        # The row's live slots equal those of the kept tokens decoded alone, with no rejection.
        _, alone = _prefix(params, row[:len(prompts[b])], 32, mode)
        for t in row[len(prompts[b]):]:
            _, alone = jaxllm.decode_step(params, [t], alone)
        start, end = int(cache.start[b]), int(cache.end[b])
        assert end - start == len(row) == int(alone.end[0])
        for layer in (0, len(cache.k) - 1):
            np.testing.assert_allclose(cache.k[layer][b, :, start:end], alone.k[layer][0, :, :len(row)],
                                       rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(cache.v[layer][b, :, start:end], alone.v[layer][0, :, :len(row)],
                                       rtol=1e-5, atol=1e-5)


def test_a_released_row_reads_nothing_of_its_previous_request(tiny, mode):
    """A long request leaves row 0, which is released: a short request then prefilled into it
    token by token, or inserted, gets the tokens of a fresh run, though the row's slots past its
    end still hold the long request's keys and values."""
    m = tiny("mistral")
    params = m.params
    prompts = [random_tokens(14, seed=60), random_tokens(6, seed=61)]
    logits, cache = _running_batch(params, prompts, 48, mode)
    _, _, cache = _decode(params, cache, _greedy(logits), 10)
    cache = release(cache, jnp.asarray([True, False]))
    assert np.asarray(cache.start)[0] == np.asarray(cache.end)[0] == 0
    assert np.asarray(cache.end)[1] == 26  # the other row is untouched

    short = random_tokens(3, seed=62)
    alone = jaxllm.generate(params, [short.tolist()], max_new_tokens=6, eos_token_ids=[], kv_dtype=mode)
    # Through decode steps: row 0 takes the prompt a token a step while row 1 decodes on.
    reused = cache
    for t in short:
        logits, reused = jaxllm.decode_step(params, [t, 5], reused)
    token_B = _greedy(logits)
    tokens, _, _ = _decode(params, reused, token_B, 5)
    np.testing.assert_array_equal(np.concatenate([[token_B[0]], tokens[:, 0]]), alone.tokens[0])
    # Through insert, after the row was released.
    first, prefix = _prefix(params, short, kv_dtype=mode)
    cache = insert(cache, prefix, jnp.int32(0))
    tokens, _, _ = _decode(params, cache, np.asarray([_greedy(first)[0], 5], np.int32), 5)
    np.testing.assert_array_equal(np.concatenate([_greedy(first), tokens[:, 0]]), alone.tokens[0])


def test_a_step_over_the_first_rows_leaves_the_others_alone(tiny, mode):
    """A step given fewer token rows than the cache has (a serving engine's step over its rows in
    use) advances those rows as a cache of them alone would, and leaves every other row's slots
    and bounds as they were."""
    params = tiny("mistral").params  # a 4-token window, passed within the steps
    prompts = [random_tokens(n, seed=70 + n) for n in (9, 5, 12)]
    logits, cache = _running_batch(params, prompts, 32, mode)
    step = jitted_step()
    alone = jax.tree.map(lambda x: x[:2], cache)
    token_2 = jnp.asarray(_greedy(logits)[:2, None])
    for _ in range(6):
        want, alone = step(params, token_2, alone)
        got, stepped = step(params, token_2, cache)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
        for new, old, own in zip(jax.tree.leaves(stepped), jax.tree.leaves(cache), jax.tree.leaves(alone)):
            np.testing.assert_array_equal(np.asarray(new[2:]), np.asarray(old[2:]))  # row 2 untouched
            np.testing.assert_array_equal(np.asarray(new[:2]), np.asarray(own))
        cache, token_2 = stepped, jnp.asarray(_greedy(got)[:, None])


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_a_mixed_step_is_the_decode_step_and_the_prefill_it_joins(tiny, mode, name):
    """`mixed_step`, one pass over the first rows' decode tokens and two left-padded prompts (a
    serving engine's step that admits requests), gives each part's logits and cache rows as the
    decode step and the fresh prefill run apart would."""
    from jaxllm.model.transformer import mixed_step
    params = tiny(name).params
    logits, cache = _running_batch(params, [random_tokens(n, seed=80 + n) for n in (9, 5, 12)], 48, mode)
    token_2 = jnp.asarray(_greedy(logits)[:2])
    prompts = random_tokens((2, 16), seed=8)
    start = np.array([5, 0], np.int32)
    want_n, want_cache = jitted_step()(params, token_2[:, None], cache)
    want_b, want_fresh = jitted_step()(params, jnp.asarray(prompts),
                                       init_cache(params.config, 2, 16, params.dtype, start, kv_dtype=mode), fresh=True)
    got_n, got_b, got_cache, got_fresh = jax.jit(mixed_step)(params, token_2, cache, jnp.asarray(prompts), start)
    assert rel_err(got_n, want_n) < 1e-5 and rel_err(got_b, want_b) < 1e-5
    for got, want in ((got_cache, want_cache), (got_fresh, want_fresh)):
        for new, old in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(new, np.float32), np.asarray(old, np.float32), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["mistral", "qwen3"])
def test_a_step_returns_the_logits_of_every_new_position(tiny, name):
    """`step(..., all_logits=True)` of 4 tokens a row over a warm cache whose rows end at
    different slots (one left-padded) equals `forward` at those positions."""
    m = tiny(name)
    params = m.params
    prompts = [random_tokens(n, seed=70 + n) for n in (4, 9, 6)]
    cache = init_cache(params.config, 3, 32, params.dtype)
    for b, prompt in enumerate(prompts):
        width = 16 if b == 2 else len(prompt)  # row 2 left-padded: it starts at slot 10
        tokens, start, _ = pad_prompts(params, [prompt.tolist()])
        one = init_cache(params.config, 1, width, params.dtype, start=start if b == 2 else None)
        cache = insert(cache, jaxllm.prefill(params, tokens[:, -width:], one)[1], jnp.int32(b))
    np.testing.assert_array_equal(np.asarray(cache.lengths), [4, 9, 6])
    new = random_tokens((3, 4), seed=4)
    logits_BTV, after = jitted_step()(params, jnp.asarray(new), cache, all_logits=True)
    last_BV, _ = jitted_step()(params, jnp.asarray(new), cache)
    assert logits_BTV.shape == (3, 4, params.config.vocab_size)
    np.testing.assert_array_equal(np.asarray(after.end), [8, 13, 20])
    for b, prompt in enumerate(prompts):
        ref = np.asarray(jaxllm.forward(params, np.concatenate([prompt, new[b]])[None]))[0, len(prompt):]
        assert rel_err(logits_BTV[b], ref) < 1e-4, f"row {b}"
    np.testing.assert_allclose(last_BV, logits_BTV[:, -1], rtol=1e-6, atol=1e-6)


def test_room_is_checked_against_the_furthest_row(llama):
    """decode_step refuses a step that would write past the last slot in any row, and one whose
    longest row would pass the model's context."""
    params = llama.params
    cache = init_cache(params.config, 2, 8, params.dtype)
    full = cache.replace(end=jnp.asarray([3, 8], jnp.int32))
    with pytest.raises(ValueError, match=r"cache full: writing 1 token\(s\) at slot 8 needs 9 slots"):
        jaxllm.decode_step(params, [5, 5], full)
    context = params.config.max_position_embeddings
    long = init_cache(params.config, 2, context + 8, params.dtype)
    long = long.replace(start=jnp.asarray([0, 8], jnp.int32), end=jnp.asarray([context, context + 7], jnp.int32))
    with pytest.raises(ValueError, match=rf"reaches position {context}, past the model's context"):
        jaxllm.decode_step(params, [5, 5], long)
