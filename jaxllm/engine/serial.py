"""SerialEngine: the interim engine behind `jaxllm serve`, one request at a time.

It satisfies jaxllm.engine.api's contract with one engine thread that runs each request alone
through the public step API (`prefill`, `decode_step` on a cache from `init_cache`), so the
server and its tests work before the continuous-batching engine exists; that engine replaces this
one behind the same interface. It has one slot: a second request waits in the bounded queue.
Greedy results equal `jaxllm.generate`'s for the same prompt (same left padding to a bucket, same
sampling, the same key per token index).
"""

from __future__ import annotations

import collections
import threading
import traceback
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.engine.generate import MIN_BUCKET, bucket
from jaxllm.engine.sampling import apply_repetition_penalty, sample, seed_key, seed_words
from jaxllm.engine.steps import decode_step, prefill
from jaxllm.model.cache import init_cache
from jaxllm.model.transformer import rotation_table

from jaxllm.engine.api import (MAX_TOP_LOGPROBS, EngineClosed, Event, OnEvent, QueueFull, Request,
                               TokenLogprob)

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compilations = 0
_listening = False


def _count_compilation(event: str, duration: float, **_) -> None:
    global _compilations
    if event == _COMPILE_EVENT:
        _compilations += 1


def compilations() -> int:
    """XLA compilations in this process since the first engine was made (every jit, ours or not)."""
    return _compilations


@partial(jax.jit, static_argnames=("greedy", "logprobs"))
def _choose(logits_1V, counts_1V, seen_1V, key, index, values, greedy: bool, logprobs: bool):
    """The next token of one row, with OpenAI's presence/frequency penalties (output tokens) and
    transformers' repetition penalty (prompt and output) before `sample`; and, if asked, the raw
    distribution's log-probability of it and the top MAX_TOP_LOGPROBS (vLLM's default).

    Every filter and penalty is always applied, with neutral values where a request has none
    (see `_values`), so four programs serve every request: nothing compiles after warm-up."""
    temperature, top_k, top_p, min_p, repetition, presence, frequency = values
    scored = apply_repetition_penalty(logits_1V, seen_1V, repetition)
    scored = scored - presence * (counts_1V > 0) - frequency * counts_1V
    token_1 = sample(scored, jax.random.fold_in(key, index), temperature, top_k, top_p, min_p,
                     greedy=greedy, use_top_k=True, use_top_p=True, use_min_p=True)
    if not logprobs:
        return token_1, None
    logp_1V = jax.nn.log_softmax(logits_1V, axis=-1)
    chosen_1 = jnp.take_along_axis(logp_1V, token_1[:, None], axis=-1)[:, 0]
    top_1K, ids_1K = jax.lax.top_k(logp_1V, MAX_TOP_LOGPROBS)
    return token_1, (chosen_1, top_1K, ids_1K)


def _values(r: Request, vocab: int) -> tuple:
    """`_choose`'s traced settings; neutral ones leave the logits exactly as they are: top_k of
    the whole vocabulary, top_p 2 (the mass above any token is below it), min_p 0, penalties 1
    and 0 (x / 1 and x - 0 are x)."""
    return (jnp.float32(r.temperature), jnp.int32(r.top_k or vocab),
            *(jnp.float32(x) for x in (r.top_p if r.top_p < 1 else 2.0, r.min_p, r.repetition_penalty,
                                       r.presence_penalty, r.frequency_penalty)))


def _key(seed: int) -> jax.Array:
    return seed_key(jnp.asarray(seed_words(seed), jnp.uint32))


class SerialEngine:
    """One request at a time on one engine thread (see the module docstring)."""

    def __init__(self, params, *, eos_token_ids=(), max_context: int | None = None,
                 max_queued: int = 64, kv_dtype=None, load: Callable[[], object] | None = None):
        """`params` may be None with `load` given: `start()` calls `load()` for them (a server
        answers /health with 503 meanwhile). A request stops at `eos_token_ids` (a tokenizer's
        end-of-turn ids, say) and the model's own EOS ids, unless it says `ignore_eos`."""
        self._params, self._load = params, load
        self._eos = tuple(eos_token_ids)
        self.max_context = max_context
        self.max_queued = max_queued
        self._kv_dtype = kv_dtype
        self.max_slots = 1
        self.on_failure: Callable[[str], None] | None = None
        self._cond = threading.Condition()
        self._waiting: collections.deque = collections.deque()
        self._running: int | None = None
        self._aborted: set[int] = set()
        self._next_id = 0
        self._closing = False
        self._failed: str | None = None
        self._ready = False
        self._thread: threading.Thread | None = None
        global _listening
        if not _listening:
            jax.monitoring.register_event_duration_secs_listener(_count_compilation)
            _listening = True

    # --- the contract -------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._ready and self._failed is None and not self._closing

    def start(self) -> None:
        if self._params is None:
            self._params = self._load()
        cfg = self._params.config
        context = cfg.max_position_embeddings
        self.max_context = min(self.max_context or context, context)
        # Left padding to a bucket puts the cursor up to min(prompt, 1024) - 1 slots past the
        # prompt (generate.bucket), so that much room more than max_context.
        self._cache_length = self.max_context + min(self.max_context, 1024)
        self._stops = set(self._eos) | set(cfg.eos_token_ids)
        self._rotation = rotation_table(cfg, self._cache_length) if self._params.tp is None else None
        self._warm_up()
        self._thread = threading.Thread(target=self._loop, name="jaxllm-engine", daemon=True)
        self._thread.start()
        self._ready = True

    def submit(self, request: Request, on_event: OnEvent) -> int:
        if len(request.prompt) + request.max_tokens > self.max_context:
            raise ValueError(f"prompt of {len(request.prompt)} tokens plus max_tokens={request.max_tokens} "
                             f"is over the context of {self.max_context} tokens")
        with self._cond:
            if self._closing or self._failed is not None or not self._ready:
                raise EngineClosed(self._failed or "the engine is not running")
            if len(self._waiting) >= self.max_queued:
                raise QueueFull(f"{len(self._waiting)} requests are waiting, the most this server queues")
            rid = self._next_id
            self._next_id += 1
            self._waiting.append((rid, request, on_event))
            self._cond.notify()
        return rid

    def abort(self, request_id: int) -> None:
        with self._cond:
            for item in self._waiting:
                if item[0] == request_id:
                    self._waiting.remove(item)
                    item[2](Event(finish_reason="abort"))
                    return
            if self._running == request_id:
                self._aborted.add(request_id)

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop admitting; let the running request and the queue finish for `timeout` seconds
        (None: until done), then abort what is left and join the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread is None:
            return
        self._thread.join(timeout)
        with self._cond:
            for rid, _, on_event in self._waiting:
                on_event(Event(finish_reason="abort"))
            self._waiting.clear()
            if self._running is not None:
                self._aborted.add(self._running)
            self._cond.notify()
        self._thread.join()

    def stats(self) -> dict:
        with self._cond:
            running = int(self._running is not None)
            return dict(running=running, waiting=len(self._waiting), slots_in_use=running,
                        max_slots=self.max_slots, compilations=compilations(), failed=self._failed)

    # --- the engine thread --------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._waiting and not self._closing:
                        self._cond.wait()
                    if not self._waiting:  # closing and nothing left
                        return
                    rid, request, on_event = self._waiting.popleft()
                    self._running = rid
                try:
                    self._run(rid, request, on_event)
                except BaseException:
                    self._fail(traceback.format_exc(limit=4), (rid, on_event))
                    return
                with self._cond:
                    self._running = None
                    self._aborted.discard(rid)
        except BaseException:
            self._fail(traceback.format_exc(limit=4))

    def _fail(self, error: str, running=None) -> None:
        with self._cond:
            self._failed = error.strip().splitlines()[-1] or "engine failed"
            self._ready = False
            open_requests = ([running] if running else []) + [(r, f) for r, _, f in self._waiting]
            self._waiting.clear()
            self._running = None
        for _, on_event in open_requests:
            on_event(Event(finish_reason="error", error=self._failed))
        if self.on_failure is not None:
            self.on_failure(self._failed)

    def _is_aborted(self, rid: int) -> bool:
        with self._cond:
            return rid in self._aborted

    def _first_logits(self, prompt: list[int]):
        """Prefill of one prompt, left-padded to its bucket as generate pads it."""
        cfg = self._params.config
        width = bucket(len(prompt))
        tokens = np.full((1, width), cfg.pad_id, np.int32)
        tokens[0, width - len(prompt):] = prompt
        cache = init_cache(cfg, 1, self._cache_length, self._params.dtype,
                           np.array([width - len(prompt)], np.int32), kv_dtype=self._kv_dtype)
        return prefill(self._params, tokens, cache)

    def _run(self, rid: int, r: Request, on_event: OnEvent) -> None:
        V = self._params.config.vocab_size
        values = _values(r, V)
        stops = set(r.stop_token_ids) | (set() if r.ignore_eos else self._stops)
        key = _key(r.seed)
        counts = np.zeros((1, V), np.float32)
        seen = np.zeros((1, V), bool)
        seen[0, list(r.prompt)] = True
        logits, cache = self._first_logits(list(r.prompt))
        for i in range(r.max_tokens):
            if self._is_aborted(rid):
                on_event(Event(finish_reason="abort"))
                return
            token_1, lp = _choose(logits, jnp.asarray(counts), jnp.asarray(seen), key, jnp.int32(i),
                                  values, r.temperature == 0, r.logprobs is not None)
            token = int(np.asarray(token_1)[0])
            logprobs = None
            if lp is not None:
                chosen, top, ids = (np.asarray(x)[0] for x in lp)
                logprobs = [TokenLogprob(token, float(chosen), tuple(
                    (int(t), float(p)) for t, p in zip(ids[:r.logprobs], top[:r.logprobs])))]
            finish = "stop" if token in stops else "length" if i + 1 == r.max_tokens else None
            on_event(Event([token], logprobs, finish))
            if finish:
                return
            counts[0, token] += 1
            seen[0, token] = True
            logits, cache = decode_step(self._params, np.array([token], np.int32), cache, self._rotation)

    def _warm_up(self) -> None:
        """Compile the prefill of every prompt bucket up to max_context, a decode step and the
        four samplers (greedy or not, logprobs or not)."""
        width = MIN_BUCKET
        while True:
            logits, cache = self._first_logits([0] * min(width, self.max_context))
            if width >= self.max_context:
                break
            width = bucket(width + 1)
        decode_step(self._params, np.array([0], np.int32), cache, self._rotation)
        V = self._params.config.vocab_size
        _key(2 ** 40)  # a seed past 32 bits folds its high bits in: one more small program
        for temperature in (0.0, 1.0):
            for logprobs in (False, True):
                _choose(logits, jnp.zeros((1, V), jnp.float32), jnp.zeros((1, V), bool), _key(0), jnp.int32(0),
                        _values(Request((0,), 1, temperature=temperature), V), temperature == 0, logprobs)

