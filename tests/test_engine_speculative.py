"""The serving engine with speculation (prompt lookup, a draft model), on test_engine's tiny
float32 model.

Speculation must not change a greedy request's tokens (each equals `generate` alone, whatever
else runs), a seeded sampled request draws the same tokens alone and under load, a stop id or
max_tokens inside an accepted run ends the request there, and nothing compiles after ready.
"""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest

import jaxllm
from jaxllm.engine import speculative as spec
from jaxllm.engine.api import Request
from test_engine import VOCAB, Collector, _alone, _prompt, _run, _wait_idle, params  # noqa: F401 (a fixture)

# slow: an engine of its own compiles every decode bucket twice over (plain and speculative)
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:.*recompiling generate")]

MAX_SLOTS = 4
MAX_CONTEXT = 96
CHUNK = 32
K = 3
# A speculating bucket of 2 rows below the 4: the rows past it keep their bounds (a server's
# 8-row bucket of 64 slots failed to compile)
DECODE_ROWS = (1, 2)
# Mixed steps (a prompt inside the largest, non-speculating bucket's step) are test_engine's; left
# out here, as their programs are the slowest of an engine's to compile
MIXED = False
# One matching token proposes: a random tiny model's answers seldom repeat a pair of tokens
LOOKUP1 = spec.NGram(min_n=1)


@pytest.fixture(scope="module")
def engine(params):
    e = jaxllm.Engine(params, max_slots=MAX_SLOTS, max_context=MAX_CONTEXT, prefill_chunk=CHUNK,
                      prefill_batches=(1, 2), decode_rows=DECODE_ROWS, mixed_prefill=MIXED,
                      speculative=LOOKUP1, num_speculative=K)
    e.start()
    yield e
    e.shutdown(10)


def _repeating(rng, n, times):
    """A prompt of a random piece said `times` times: lookup finds matches."""
    return _prompt(rng, n) * times


def test_concurrent_requests_equal_generate_alone(engine, params):
    """Requests of different lengths, repeating and random prompts, a prompt longer than a chunk,
    sent at once from several threads: each gets exactly generate's greedy tokens alone, and
    drafts were accepted."""
    rng = random.Random(0)
    jobs = [(_repeating(rng, rng.randrange(2, 8), 3), rng.randrange(4, 30)) for _ in range(8)]
    jobs += [(_prompt(rng, rng.randrange(1, 30)), rng.randrange(1, 24)) for _ in range(4)]
    jobs += [(_repeating(rng, 9, 5), 20)]  # 45 tokens: prefilled in chunks
    before = _wait_idle(engine)
    got = [Collector() for _ in jobs]

    def send(indices):
        for i in indices:
            engine.submit(Request(jobs[i][0], jobs[i][1], ignore_eos=True), got[i])
    order = list(range(len(jobs)))
    rng.shuffle(order)
    threads = [threading.Thread(target=send, args=(order[k::3],)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for i, (prompt, n) in enumerate(jobs):
        c = got[i].wait()
        assert c.events[-1].finish_reason == "length"
        assert c.tokens == _alone(params, prompt, n), f"request {i} (prompt {len(prompt)}, {n} tokens)"
    after = _wait_idle(engine)
    assert after["slots_in_use"] == 0
    assert after["spec_steps"] > before["spec_steps"]
    assert after["spec_accepted"] > before["spec_accepted"]
    assert after["spec_proposed"] >= after["spec_accepted"]
    # accepted drafts came as events of several tokens
    assert any(len(e.token_ids) > 1 for c in got for e in c.events)


def test_penalties_equal_generate_alone(engine, params):
    """The penalties' history holds every accepted token: greedy with penalties is plain's."""
    rng = random.Random(1)
    for settings in (dict(repetition_penalty=1.3), dict(presence_penalty=0.5, frequency_penalty=0.7)):
        prompt = _repeating(rng, 5, 3)
        c = _run(engine, Request(prompt, 24, ignore_eos=True, **settings))
        assert c.tokens == _alone(params, prompt, 24, **settings)


@pytest.fixture(scope="module")
def cycling(params, engine):
    """(params, engine) of the model without its attention's output: its next token depends on
    the last one alone, so its answers fall into cycles, which prompt lookup drafts in whole runs
    (the engine's settings are `engine`'s: it reuses the programs `engine` compiled first)."""
    p = params.replace(layers=[layer.replace(wo=layer.wo * 0) for layer in params.layers])
    e = jaxllm.Engine(p, max_slots=MAX_SLOTS, max_context=MAX_CONTEXT, prefill_chunk=CHUNK,
                      prefill_batches=(1, 2), decode_rows=DECODE_ROWS, mixed_prefill=MIXED,
                      speculative=LOOKUP1, num_speculative=K)
    e.start()
    yield p, e
    e.shutdown(10)


def _retelling(params, seed, n=10):
    """A prompt that tells the model's own next n tokens after a token y, then y again: its
    answer retells them, which lookup drafts from the prompt (tokens new to the answer)."""
    y = random.Random(seed).randrange(3, VOCAB)
    return tuple([y] + _alone(params, [y], n) + [y])


def test_whole_accepted_runs_equal_generate_alone(cycling):
    """Rounds that accept every draft (the bonus token after them) and rounds that accept some,
    several rows at once: generate's tokens, in events of several tokens."""
    params, engine = cycling
    prompts = [_retelling(params, seed) for seed in (2, 3)] + [_prompt(random.Random(4), 8)]
    cs = [Collector() for _ in prompts]
    for prompt, c in zip(prompts, cs):
        engine.submit(Request(prompt, 40, ignore_eos=True), c)
    for prompt, c in zip(prompts, cs):
        assert c.wait().tokens == _alone(params, prompt, 40)
    assert all(max(len(e.token_ids) for e in c.events) == K + 1 for c in cs[:2])
    s = _wait_idle(engine)
    assert s["spec_accepted"] > s["spec_steps"]


def _multi_token_event(c: Collector):
    """(tokens before it, its tokens) of the first event of several tokens."""
    made = 0
    for e in c.events:
        if len(e.token_ids) > 1:
            return made, e.token_ids
        made += len(e.token_ids)
    raise AssertionError("no step accepted a draft")


def test_stop_id_and_max_tokens_inside_an_accepted_run(cycling):
    """A stop id that came inside an accepted run ends the request at it (finish stop); a
    max_tokens that falls inside one ends it there (finish length); logprobs come for each token."""
    params, engine = cycling
    prompt = _retelling(params, 5)
    expected = _alone(params, prompt, 40)
    free = _run(engine, Request(prompt, 40, ignore_eos=True))
    assert free.tokens == expected
    made, run = _multi_token_event(free)
    stop = next(t for t in run[:-1] if t not in expected[:made])  # not made before the run
    c = _run(engine, Request(prompt, 40, ignore_eos=True, stop_token_ids=(stop,), logprobs=2))
    assert c.tokens == expected[:expected.index(stop) + 1]
    assert c.events[-1].finish_reason == "stop"
    lps = [lp for e in c.events for lp in e.logprobs]
    assert [lp.token_id for lp in lps] == c.tokens
    assert all(len(lp.top) == 2 and lp.top[0][0] == lp.token_id and lp.logprob <= 0 for lp in lps)
    c = _run(engine, Request(prompt, made + 1, ignore_eos=True))
    assert c.tokens == expected[:made + 1]
    assert c.events[-1].finish_reason == "length"


def test_seeded_sampling_is_the_same_alone_and_under_load(engine, params):
    """A seed gives the same tokens alone and beside other requests, and the tokens of generate's
    speculative loop with the same k and seed (a verify round's key is the row's seed folded by its
    token index, as a plain step's)."""
    rng = random.Random(3)
    prompt = _repeating(rng, 4, 3)
    settings = dict(temperature=0.8, top_p=0.95, top_k=40)
    alone = _run(engine, Request(prompt, 24, seed=7, ignore_eos=True, **settings)).tokens
    out = jaxllm.generate(params, [list(prompt)], max_new_tokens=24, eos_token_ids=[], seed=7,
                          speculative=LOOKUP1, num_speculative=K, **settings)
    assert alone == np.asarray(out.tokens[0]).tolist()
    background = [Collector() for _ in range(MAX_SLOTS - 1)]
    for i, b in enumerate(background):
        engine.submit(Request(_repeating(rng, 3, 3), 30, temperature=1.0, seed=100 + i, ignore_eos=True), b)
    assert _run(engine, Request(prompt, 24, seed=7, ignore_eos=True, **settings)).tokens == alone
    for b in background:
        b.wait()


def test_larger_buckets_decode_plainly_and_the_tokens_do_not_change(params, monkeypatch):
    """With speculation in one-row steps only, requests that come and go switch between verify
    steps and plain ones (which keep each row's tokens for the next lookup): greedy tokens are
    still generate's."""
    monkeypatch.setattr(spec, "TUNING", spec.SpecTuning(max_batch=1))
    e = jaxllm.Engine(params, max_slots=2, max_context=64, prefill_chunk=32, prefill_batches=(1,),
                      decode_rows=(1,), mixed_prefill=MIXED, speculative=LOOKUP1, num_speculative=K)
    e.start()
    try:
        rng = random.Random(4)
        jobs = [(_repeating(rng, 4, 3), 30), (_repeating(rng, 3, 3), 8), (_repeating(rng, 5, 2), 12)]
        cs = [Collector() for _ in jobs]
        for (prompt, n), c in zip(jobs, cs):
            e.submit(Request(prompt, n, ignore_eos=True), c)
        for (prompt, n), c in zip(jobs, cs):
            assert c.wait().tokens == _alone(params, prompt, n)
        s = _wait_idle(e)
        assert s["spec_steps"] > 0 and s["spec_accepted"] > 0
        assert s["computed_rows"] > s["decode_steps"]  # some steps took the two-row bucket
    finally:
        e.shutdown(10)


def test_a_speculative_step_updates_the_cache_in_place(params):
    """The donated cache is written in place: the compiled step copies no layer's cache (a
    `lax.cond` between a verify and a plain step copied each one three times)."""
    import re

    import jax
    import jax.numpy as jnp

    from jaxllm.engine import batching
    from jaxllm.model.cache import init_cache
    from jaxllm.model.transformer import rotation_table

    cfg, B, S = params.config, 4, 128
    rows = batching.Rows(init_cache(cfg, B, S, jnp.float32), jnp.zeros((B, VOCAB), bool),
                         jnp.zeros((B, VOCAB), jnp.int32), jnp.zeros((B, S), jnp.int32))
    nxt = batching.Next(np.zeros((B,), np.int32), np.zeros((B,), np.int32), batching._sampling_values([None] * B),
                        batching.Pause.fresh(B))
    program = jax.jit(batching._speculate, donate_argnums=(1,), static_argnames=("flags", "logprobs", "k", "proposer"))
    hlo = program.lower(params, rows, nxt, np.zeros((1,), bool), rotation_table(cfg, S), np.zeros((4,), np.float32),
                        flags=batching.EVERY,
                        logprobs=True, k=K, proposer=LOOKUP1).compile().as_text()
    shape = rf"f32\[{B},{cfg.num_kv_heads},{S},{cfg.head_dim}\]"
    assert re.search(rf"= {shape}\{{[^}}]*\}} dynamic-update-slice|= {shape}\{{[^}}]*\}} (fusion|scatter)", hlo)
    assert not re.search(rf"= {shape}\{{[^}}]*\}} copy\(", hlo)


def test_bad_arguments_are_named(params):
    with pytest.raises(ValueError, match="by prompt lookup .* or with a draft model"):
        jaxllm.Engine(params, speculative="draft")
    with pytest.raises(ValueError, match="num_speculative needs"):
        jaxllm.Engine(params, num_speculative=3)
    with pytest.raises(ValueError, match="num_speculative"):
        jaxllm.Engine(params, speculative="ngram", num_speculative=0)


def test_no_compilation_after_ready(engine):
    """Every setting, logprobs and prompt length runs on what start() compiled (run last)."""
    rng = random.Random(7)
    before = engine.stats()["compilations"]
    assert before == engine.stats()["warmup_compilations"] > 0
    cs = []
    for i, extra in enumerate([dict(temperature=0.7, top_p=0.9, seed=2 ** 40), dict(temperature=1.0, logprobs=3),
                               dict(presence_penalty=0.5, frequency_penalty=0.5), dict(logprobs=0),
                               dict(temperature=0.5, top_k=5, min_p=0.1, repetition_penalty=1.3)]):
        cs.append(Collector())
        engine.submit(Request(_repeating(rng, 3, 2 + 4 * i), 6, **extra), cs[-1])  # 6 to 54 tokens
    for c in cs:
        c.wait()
    assert engine.stats()["compilations"] == before


# --- a draft model ---------------------------------------------------------------------------------


def _perturbed(params, scale, seed=9):
    """The target with noise on every weight: a draft that agrees with it often, not always."""
    import jax
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [x + scale * jax.random.normal(k, x.shape, x.dtype) if hasattr(x, "dtype") and x.dtype.kind == "f" else x
             for x, k in zip(leaves, keys)]
    return jax.tree.unflatten(tree, noisy)


@pytest.fixture(scope="module", params=["itself", "perturbed"])
def drafted(params, request):
    """(draft, engine): the target speculating with itself as the draft (every draft accepted) or
    with a noisy copy (some accepted, some not); both of one shape, so they share the compilations."""
    draft = params if request.param == "itself" else _perturbed(params, 0.01)
    e = jaxllm.Engine(params, max_slots=MAX_SLOTS, max_context=MAX_CONTEXT, prefill_chunk=CHUNK,
                      prefill_batches=(1, 2), decode_rows=DECODE_ROWS, mixed_prefill=MIXED,
                      speculative=draft, num_speculative=K)
    e.start()
    yield request.param, e
    e.shutdown(10)


def test_a_draft_model_gives_each_request_generate_alone(drafted, params):
    """Requests of different lengths at once, a prompt longer than a chunk among them: each gets
    generate's greedy tokens alone; a draft equal to the target has every draft accepted, in events
    of k + 1 tokens; a noisy one has some rejected. Nothing compiles after ready."""
    kind, engine = drafted
    rng = random.Random(10)
    jobs = [(_prompt(rng, rng.randrange(1, 30)), rng.randrange(1, 30)) for _ in range(9)]
    jobs += [(_prompt(rng, 45), 20)]  # prefilled in chunks, the draft's cache too
    before = _wait_idle(engine)
    got = [Collector() for _ in jobs]
    for (prompt, n), c in zip(jobs, got):
        engine.submit(Request(prompt, n, ignore_eos=True), c)
    for i, (prompt, n) in enumerate(jobs):
        c = got[i].wait()
        assert c.tokens == _alone(params, prompt, n), f"request {i} (prompt {len(prompt)}, {n} tokens)"
    after = _wait_idle(engine)
    assert after["slots_in_use"] == 0
    assert after["compilations"] == after["warmup_compilations"]
    accepted = after["spec_accepted"] - before["spec_accepted"]
    proposed = after["spec_proposed"] - before["spec_proposed"]
    if kind == "itself":
        assert accepted == proposed > 0
        assert any(len(e.token_ids) == K + 1 for c in got for e in c.events)
    else:
        assert 0 < accepted < proposed


def test_a_draft_models_seeded_sampling_is_generates(drafted, params):
    """A seeded sampled request draws generate's tokens with the same draft, k and seed, alone and
    beside other requests."""
    kind, engine = drafted
    draft = params if kind == "itself" else _perturbed(params, 0.01)
    rng = random.Random(11)
    prompt = _prompt(rng, 12)
    settings = dict(temperature=0.9, top_k=50)
    out = jaxllm.generate(params, [list(prompt)], max_new_tokens=24, eos_token_ids=[], seed=5,
                          speculative=draft, num_speculative=K, **settings)
    expected = np.asarray(out.tokens[0]).tolist()
    assert _run(engine, Request(prompt, 24, seed=5, ignore_eos=True, **settings)).tokens == expected
    background = [Collector() for _ in range(MAX_SLOTS - 1)]
    for i, b in enumerate(background):
        engine.submit(Request(_prompt(rng, 5 + i), 30, temperature=1.0, seed=100 + i, ignore_eos=True), b)
    assert _run(engine, Request(prompt, 24, seed=5, ignore_eos=True, **settings)).tokens == expected
    for b in background:
        b.wait()


def test_a_row_pauses_while_its_drafts_are_rejected(params):
    """Without num_speculative a row whose rounds keep one token pauses for 4, 8, 16... tokens: a
    draft the target never agrees with is checked a few times over 60 tokens, not every step (as
    with k fixed), and the tokens are still generate's."""
    import jax

    stranger = jaxllm.init_params(params.config, jax.random.key(5), dtype=params.dtype, scale=0.3)
    prompt = _prompt(random.Random(12), 10)
    proposed = {}
    for k in (None, K):
        e = jaxllm.Engine(params, max_slots=MAX_SLOTS, max_context=MAX_CONTEXT, prefill_chunk=CHUNK,
                          prefill_batches=(1, 2), decode_rows=DECODE_ROWS, mixed_prefill=MIXED,
                          speculative=stranger, num_speculative=k)
        e.start()
        try:
            assert _run(e, Request(prompt, 60, ignore_eos=True)).tokens == _alone(params, prompt, 60)
            s = _wait_idle(e)
            proposed[k] = s["spec_proposed"]
            assert s["spec_accepted"] <= 2 and s["compilations"] == s["warmup_compilations"]
        finally:
            e.shutdown(10)
    assert proposed[K] >= 50 * K  # every step checked k drafts
    assert 0 < proposed[None] <= 6 * K


def test_a_draft_of_another_vocabulary_is_named_at_start(params):
    import dataclasses

    import jax
    other = jaxllm.init_params(dataclasses.replace(params.config, vocab_size=VOCAB + 64), jax.random.key(3),
                               dtype=params.dtype)
    e = jaxllm.Engine(params, max_slots=1, max_context=32, prefill_chunk=32, speculative=lambda: other)
    with pytest.raises(ValueError, match="draft model's vocabulary"):
        e.start()
