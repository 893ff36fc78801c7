"""The continuous-batching engine in-process (jaxllm.Engine), on a tiny random float32 model.

Continuous batching must not change results: each request gets exactly the tokens `generate`
gives it alone, whatever else runs, in whichever row, after whichever occupant. One engine per
module; every wait bounded.
"""

from __future__ import annotations

import random
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxllm
from jaxllm.engine.api import Event, QueueFull, Request
from jaxllm.model.config import ModelConfig

pytestmark = pytest.mark.filterwarnings("ignore:.*recompiling generate")

MAX_SLOTS = 4
MAX_CONTEXT = 96
CHUNK = 32
MAX_QUEUED = 40
VOCAB = 512


@pytest.fixture(scope="module")
def params():
    cfg = ModelConfig(model_type="llama", vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, ffn_size=128, max_position_embeddings=256,
                      eos_token_ids=(2,))
    # large weights: logits far apart, so greedy picks have clear margins
    return jaxllm.init_params(cfg, jax.random.key(0), dtype=jnp.float32, scale=0.3)


@pytest.fixture(scope="module")
def engine(params):
    e = jaxllm.Engine(params, max_slots=MAX_SLOTS, max_context=MAX_CONTEXT, max_queued=MAX_QUEUED,
                      prefill_chunk=CHUNK, prefill_batches=(1, 2))
    e.start()
    yield e
    e.shutdown(10)


class Collector:
    """One request's events, and an Event set when its last one came."""

    def __init__(self):
        self.events: list[Event] = []
        self.finished = threading.Event()

    def __call__(self, event: Event) -> None:
        self.events.append(event)
        if event.finish_reason is not None:
            self.finished.set()

    @property
    def tokens(self) -> list[int]:
        return [t for e in self.events for t in e.token_ids]

    def wait(self, timeout: float = 60) -> "Collector":
        assert self.finished.wait(timeout), "the request did not finish"
        return self


def _alone(params, prompt, n, **sampling):
    out = jaxllm.generate(params, [list(prompt)], max_new_tokens=n, eos_token_ids=[], **sampling)
    return [int(t) for t in np.asarray(out.tokens[0])]


def _prompt(rng, n):
    return tuple(rng.randrange(3, VOCAB) for _ in range(n))


def _run(engine, request) -> Collector:
    c = Collector()
    engine.submit(request, c)
    return c.wait()


def _tokens_of_each(engine, jobs) -> list[list[int]]:
    """Submit (prompt, max_tokens) jobs at once and wait for every one's tokens."""
    cs = [Collector() for _ in jobs]
    for (prompt, n), c in zip(jobs, cs):
        engine.submit(Request(prompt, n, ignore_eos=True), c)
    return [c.wait().tokens for c in cs]


def _wait_idle(engine, timeout=30):
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if s["running"] == 0 and s["waiting"] == 0:
            return s
        time.sleep(0.01)
    raise TimeoutError(engine.stats())


def test_concurrent_requests_equal_generate_alone(engine, params):
    """32 requests of different lengths, submitted at once in shuffled order from several threads:
    each gets exactly the greedy tokens generate gives it alone."""
    rng = random.Random(0)
    jobs = [(_prompt(rng, rng.randrange(1, 40)), rng.randrange(1, 24)) for _ in range(32)]
    order = list(range(32))
    rng.shuffle(order)
    got: dict[int, Collector] = {}

    def send(indices):
        for i in indices:
            got[i] = Collector()
            engine.submit(Request(jobs[i][0], jobs[i][1], ignore_eos=True), got[i])
    threads = [threading.Thread(target=send, args=(order[k::4],)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for i, (prompt, n) in enumerate(jobs):
        c = got[i].wait()
        assert c.events[-1].finish_reason == "length"
        assert c.tokens == _alone(params, prompt, n), f"request {i} (prompt {len(prompt)}, {n} tokens)"
    s = _wait_idle(engine)
    assert s["slots_in_use"] == 0
    assert s["occupied_rows"] > 2 * s["decode_steps"]  # the rows ran together
    assert s["mixed_steps"] > 0  # some prompts were prefilled in the decode rows' pass


def test_a_lone_request_steps_one_row(engine, params):
    """A request takes the lowest free row and a decode step computes the rows up to the last
    running one (a decode bucket): a lone stream runs one-row steps (a GPU's batch-1 kernels),
    with generate's tokens."""
    before = _wait_idle(engine)
    prompt = _prompt(random.Random(5), 9)
    assert _run(engine, Request(prompt, 12, ignore_eos=True)).tokens == _alone(params, prompt, 12)
    after = _wait_idle(engine)
    steps = after["decode_steps"] - before["decode_steps"]
    assert steps >= 11 and after["computed_rows"] - before["computed_rows"] == steps


def test_a_row_a_long_request_left_equals_a_fresh_run(engine, params):
    """A short request in the row a long one just left sees nothing of its previous occupant."""
    rng = random.Random(1)
    long_prompt, short_prompt = _prompt(rng, 60), _prompt(rng, 5)
    _run(engine, Request(long_prompt, MAX_CONTEXT - 60, ignore_eos=True))
    assert _run(engine, Request(short_prompt, 12, ignore_eos=True)).tokens == _alone(params, short_prompt, 12)


def test_prompts_longer_than_a_chunk_equal_generate(engine, params):
    rng = random.Random(2)
    prompts = [_prompt(rng, n) for n in (CHUNK + 1, 2 * CHUNK, 2 * CHUNK + 7)]
    cs = []
    for p in prompts:  # with short ones decoding alongside
        cs.append(Collector())
        engine.submit(Request(p, 10, ignore_eos=True), cs[-1])
        cs.append(Collector())
        engine.submit(Request(p[:9], 10, ignore_eos=True), cs[-1])
    for k, p in enumerate(prompts):
        assert cs[2 * k].wait().tokens == _alone(params, p, 10)
        assert cs[2 * k + 1].wait().tokens == _alone(params, p[:9], 10)


def test_running_streams_get_tokens_between_the_chunks_of_a_long_prompt(engine):
    """A long prompt is prefilled a chunk at a time, a decode step between two chunks: a running
    stream gets a token while each chunk count is current."""
    rng = random.Random(8)
    seen_chunks = []
    c = Collector()
    started = threading.Event()

    def on_event(event):  # on the engine thread: stats() shows the chunk calls made so far
        seen_chunks.append(engine.stats()["chunk_calls"])
        c(event)
        started.set()
    engine.submit(Request(_prompt(rng, 4), 60, ignore_eos=True), on_event)
    assert started.wait(30)
    before = engine.stats()["chunk_calls"]
    long = _run(engine, Request(_prompt(rng, 2 * CHUNK + 5), 2, ignore_eos=True))
    assert len(long.tokens) == 2
    c.wait()
    assert set(range(before, before + 3)) <= set(seen_chunks)


def test_a_short_prompt_does_not_wait_for_a_long_one_to_be_prefilled(engine, params):
    rng = random.Random(9)
    order = []

    def first_token(name):
        c = Collector()

        def on_event(event):
            if not c.events:
                order.append(name)
            c(event)
        return c, on_event
    (long, on_long), (short, on_short) = first_token("long"), first_token("short")
    long_prompt, short_prompt = _prompt(rng, 2 * CHUNK + 5), _prompt(rng, 6)
    engine.submit(Request(long_prompt, 3, ignore_eos=True), on_long)
    engine.submit(Request(short_prompt, 3, ignore_eos=True), on_short)
    assert long.wait().tokens == _alone(params, long_prompt, 3)
    assert short.wait().tokens == _alone(params, short_prompt, 3)
    assert order == ["short", "long"]


def test_seeded_sampling_equals_the_same_seed_alone(engine, params):
    rng = random.Random(3)
    prompt = _prompt(rng, 11)
    settings = dict(temperature=0.9, top_p=0.9, top_k=40)
    background = [Collector() for _ in range(3)]
    for i, c in enumerate(background):
        engine.submit(Request(_prompt(rng, 7), 20, temperature=1.0, seed=100 + i, ignore_eos=True), c)
    c = _run(engine, Request(prompt, 12, seed=7, ignore_eos=True, **settings))
    assert c.tokens == _alone(params, prompt, 12, seed=7, **settings)
    for b in background:
        b.wait()


def test_stop_ids_logprobs_and_max_tokens(engine, params):
    rng = random.Random(4)
    prompt = _prompt(rng, 8)
    expected = _alone(params, prompt, 10)
    stop = expected[4]
    c = _run(engine, Request(prompt, 10, stop_token_ids=(stop,), ignore_eos=True, logprobs=3))
    assert c.tokens == expected[:expected.index(stop) + 1]
    assert c.events[-1].finish_reason == "stop"
    lps = [lp for e in c.events for lp in (e.logprobs or [])]
    assert len(lps) == len(c.tokens) and all(len(lp.top) == 3 and lp.logprob <= 0 for lp in lps)
    assert all(lp.top[0][0] == lp.token_id for lp in lps)  # greedy: the chosen token is the best


def test_abort_frees_the_row(engine):
    rng = random.Random(5)
    c = Collector()
    first = threading.Event()

    def on_event(event):
        c(event)
        first.set()
    rid = engine.submit(Request(_prompt(rng, 10), MAX_CONTEXT - 10, ignore_eos=True), on_event)
    assert first.wait(30)
    engine.abort(rid)
    c.wait()
    assert c.events[-1].finish_reason == "abort"
    assert len(c.tokens) < MAX_CONTEXT - 10
    s = _wait_idle(engine)
    assert s["slots_in_use"] == 0 and s["running"] == 0


def test_a_burst_over_capacity_gets_queue_full_and_nothing_else_fails(engine, params):
    rng = random.Random(6)
    accepted, refused = [], 0
    for _ in range(MAX_SLOTS + MAX_QUEUED + 20):
        prompt = _prompt(rng, 6)
        c = Collector()
        try:
            engine.submit(Request(prompt, 8, ignore_eos=True), c)
            accepted.append((prompt, c))
        except QueueFull:
            refused += 1
    assert refused > 0
    for prompt, c in accepted:
        assert c.wait().events[-1].finish_reason == "length" and len(c.tokens) == 8
    assert accepted[0][1].tokens == _alone(params, accepted[0][0], 8)
    assert _wait_idle(engine)["slots_in_use"] == 0


def test_over_the_context_is_refused(engine):
    with pytest.raises(ValueError, match="over the context"):
        engine.submit(Request((5,) * 90, 7), Collector())


def test_no_compilation_after_ready(engine):
    """Every setting, logprobs, seeds and prompt length (chunked too) runs on what start()
    compiled: the count is run after every other test of this module has run too."""
    rng = random.Random(7)
    before = engine.stats()["compilations"]
    assert before == engine.stats()["warmup_compilations"] > 0
    cs = []
    for i, extra in enumerate([dict(temperature=0.7, top_p=0.9, seed=2 ** 40), dict(temperature=1.0, logprobs=3),
                               dict(presence_penalty=0.5, frequency_penalty=0.5),
                               dict(temperature=0.5, top_k=5, min_p=0.1, repetition_penalty=1.3)]):
        cs.append(Collector())
        engine.submit(Request(_prompt(rng, 3 + 19 * i), 3, **extra), cs[-1])
    for c in cs:
        c.wait()
    assert engine.stats()["compilations"] == before


def test_shutdown_aborts_what_is_left(params):
    e = jaxllm.Engine(params, max_slots=2, max_context=64, prefill_chunk=32, prefill_batches=(1,))
    e.start()
    cs = [Collector() for _ in range(4)]
    for c in cs:
        e.submit(Request((5, 6, 7), 60, ignore_eos=True), c)
    e.shutdown(0)
    assert all(c.finished.is_set() for c in cs)
    assert {c.events[-1].finish_reason for c in cs} <= {"abort", "length"}
    assert not e.ready
    # Its KV cache is given back while the engine object lives on (a server's app holds it)
    cache_shape = (2, params.config.num_kv_heads)
    assert not [a for a in jax.live_arrays() if a.shape[:2] == cache_shape and a.ndim == 4]


def test_a_failing_engine_thread_ends_every_request_with_an_error(params):
    class Failing(jaxllm.Engine):
        def _deliver(self, pending):
            raise RuntimeError("injected engine failure")

    failures = []
    e = Failing(params, max_slots=2, max_context=64, prefill_chunk=32, prefill_batches=(1,))
    e.on_failure = failures.append
    e.start()
    cs = [Collector() for _ in range(3)]
    for c in cs:
        e.submit(Request((5, 6, 7), 5), c)
    for c in cs:
        assert c.wait(30).events[-1].finish_reason == "error"
        assert "injected engine failure" in c.events[-1].error
    assert failures and not e.ready
    e.shutdown(1)


@pytest.mark.slow
def test_without_mixed_prefill_the_same_tokens_come_from_fewer_programs(params):
    """`mixed_prefill=False` (`jaxllm serve --no-mixed-prefill`): no step carries a prompt, the
    warm-up leaves out the mixed programs (two a prompt width), and every request gets the tokens
    it gets with mixed steps. A config no other test uses, so that no program is compiled before."""
    rng = random.Random(3)
    jobs = [(_prompt(rng, rng.randrange(1, 30)), rng.randrange(1, 20)) for _ in range(8)]
    got, stats = {}, {}
    for mixed in (False, True):  # the second compiles only what the first did not (jit's cache)
        e = jaxllm.Engine(params, max_slots=2, max_context=100, prefill_chunk=32, prefill_batches=(1,),
                          mixed_prefill=mixed)
        e.start()
        try:
            got[mixed] = _tokens_of_each(e, jobs)
            stats[mixed] = _wait_idle(e)
        finally:
            e.shutdown(10)
    assert got[False] == got[True]
    assert stats[True]["mixed_steps"] > 0 and stats[False]["mixed_steps"] == 0
    widths = 2  # prompt buckets 16 and 32 (the chunk)
    assert stats[False]["warmup_compilations"] > 0 and stats[True]["warmup_compilations"] == 2 * widths
    prompt, n = jobs[0]
    assert got[False][0] == _alone(params, prompt, n)


@pytest.mark.slow
def test_prompts_at_a_midpoint_width_equal_generate(params, monkeypatch):
    """With JAXLLM_PROMPT_MIDPOINTS, prompts of 129-192 tokens are prefilled 192 wide (a midpoint
    between powers of two, less padding than 256) while generate pads them to 256: the same
    tokens, beside a 256-wide one."""
    from jaxllm.engine import batching
    from jaxllm.engine.batching import prompt_width
    monkeypatch.setattr(batching, "MIDPOINTS", True)
    rng = random.Random(4)
    jobs = [(_prompt(rng, 150), 6), (_prompt(rng, 190), 5), (_prompt(rng, 200), 4)]
    assert [prompt_width(len(p)) for p, _ in jobs] == [192, 192, 256]
    e = jaxllm.Engine(params, max_slots=2, max_context=220, prefill_chunk=256, prefill_batches=(1,),
                      mixed_prefill=False)
    e.start()
    try:
        assert _tokens_of_each(e, jobs) == [_alone(params, prompt, n) for prompt, n in jobs]
    finally:
        e.shutdown(10)
