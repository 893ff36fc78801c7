"""BatchingEngine: continuous batching over the rows of one preallocated KV cache.

It satisfies jaxllm.engine.api's contract (the server's engine). `max_slots` rows of one cache
of S slots each (S = max_context plus the left padding a prompt bucket adds), one row a request:

- admission takes a waiting request when a row is free; a request reserves prompt + max_tokens
  <= max_context of its own row, so nothing is ever evicted;
- a prompt of at most `prefill_chunk` tokens is prefilled with others of its length bucket (a
  few batch sizes), its first token sampled and every row inserted into its free row of the
  cache, in one jitted, donated call. A longer prompt is prefilled chunk by chunk in a one-row
  staging cache (one chunk between two decode steps, so running streams never wait for a whole
  long prompt; short prompts' prefills take turns with its chunks), and its last chunk inserts
  the row; with `mixed_prefill`, one such prompt admitted while the largest decode bucket runs
  is prefilled inside that decode step's call (`transformer.mixed_step`), not beside it;
- one jitted decode step advances every row (free rows are computed and ignored; their bounds are
  reset to [0, 0), so they write slot 0 and read nothing else); a finished or aborted row is free
  for the next insert at once;
- each row samples with its own settings (SamplingParams a row, key fold_in(key(seed), token
  index)): a request's tokens depend on its prompt, settings and seed alone. Two decode programs
  (all rows greedy and no penalties, or every filter and penalty with each row's neutral values)
  times logprobs or not (the log_softmax and top 20, only when some row asks);
- the engine thread owns the device state and blocks on its condition when idle. It dispatches
  step n + 1 before it reads step n's tokens (one device_get), so the host's work for step n (stop
  ids, events, the server's detokenizing) overlaps the device's step n + 1; a row that finished
  at step n is computed once more and ignored;
- with `speculative="ngram"` or a draft model, a decode bucket of at most `SpecTuning.batch_limit`
  rows runs a speculative round instead (`_speculate`): each row's tokens live on the device
  beside its cache (and the draft's cache), so the drafts are made inside the step, and a step in
  which no row has a draft is a plain one; a row keeps 1 to k + 1 tokens a step, which its
  request gets in one event.

Every program it runs is compiled in `start()`, before `ready`; `stats()["compilations"]` counts
the XLA compilations made on its threads (tests assert none come after ready).
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
import traceback
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxllm.engine import speculative
from jaxllm.engine.speculative import Draft
from jaxllm.engine.api import (MAX_TOP_LOGPROBS, EngineClosed, Event, OnEvent, QueueFull, Request, check_fits,
                               TokenLogprob)
from jaxllm.engine.generate import MIN_BUCKET, bucket
from jaxllm.engine.sampling import choose, record, seen_from_prompt
from jaxllm.engine.memory import check_fit
from jaxllm.engine.sampling import SamplingConfig, SamplingFlags, SamplingParams
from jaxllm.env import env_flag
from jaxllm.model.cache import KVCache, init_cache, insert, is_int8, release, rollback
from jaxllm.model.params import Params
from jaxllm.model.transformer import mixed_step, rotation_table, step

# A short prompt's prefill width: powers of two, and with JAXLLM_PROMPT_MIDPOINTS=1 also the
# midpoints between them from 192 (192, 384, 768, 1536), so a prompt there is padded by at most a
# half, not up to double; below about 200 tokens a prefill of the 8B shape costs its weights' read
# whatever its width. Off until measured on a GPU (docs/decisions/serving.md#prompt-widths).
MIDPOINTS = env_flag("JAXLLM_PROMPT_MIDPOINTS", False)
MIDPOINTS_FROM = 192


def prompt_width(n: int) -> int:
    """The bucket width a short prompt of n tokens is prefilled at (see MIDPOINTS)."""
    w = bucket(n)
    mid = w // 4 * 3
    return mid if MIDPOINTS and n <= mid and mid >= MIDPOINTS_FROM else w


# Decode buckets below max_slots: 1 (a lone stream: the one-row kernels), 8 and 32 (the rows
# kernel's range); each adds four programs to the compile set.
DECODE_ROWS = (1, 8, 32)
GREEDY = SamplingFlags()  # every running row greedy and without penalties: an argmax, no history
EVERY = SamplingFlags.every()  # otherwise: each row's own values turn off what it does not use

# --- compilation counting -----------------------------------------------------------------------

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_counting = threading.local()  # .engine: the engine whose thread this is
_listening = False


def _count_compilation(event: str, duration: float, **_) -> None:
    engine = getattr(_counting, "engine", None)
    if event == _COMPILE_EVENT and engine is not None:
        engine._compilations += 1


# --- the device programs -------------------------------------------------------------------------


@struct.dataclass
class Rows:
    """The engine's device state that each call donates: the cache, the penalties' history and,
    when it speculates, each row's tokens."""

    cache: KVCache  # [B] rows of S slots
    seen: jax.Array  # bool [B, V]: ids in the row's prompt and output (repetition penalty)
    counts: jax.Array  # int32 [B, V]: the row's output ids (presence and frequency penalties)
    # int32 [B, S] (speculating only, else None): the row's token at each cache slot, its
    # pending token (emitted, not yet in the cache) at slot end, as speculative.NGram reads them
    # and a draft model catches up from them
    seq: jax.Array | None = None
    draft: KVCache | None = None  # a draft model's cache (the same rows and slots), else None


@struct.dataclass
class Next:
    """Per-row inputs of the next decode step, small and not donated (the host may still read the
    last step's tokens while the next step runs)."""

    tokens: jax.Array  # int32 [B]: the row's last token, the next step's input
    index: jax.Array  # int32 [B]: the index of the token the next step samples
    sampling: SamplingParams  # [B]
    # speculating: each row's pause policy (`_pause`), else None
    pause: "Pause | None" = None


@struct.dataclass
class Pause:
    """A row's speculation policy, as generate's per batch: the moving mean of the tokens its
    verify rounds kept (< 0: the next round's figure replaces it), the token index from which it
    drafts again, and its next pause in tokens (0: the shortest)."""

    mean: jax.Array  # float32 [B]
    resume: jax.Array  # int32 [B]
    length: jax.Array  # int32 [B]

    @staticmethod
    def fresh(b: int) -> "Pause":
        return Pause(jnp.full((b,), -1.0, jnp.float32), jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.int32))


def _put_pause(nxt: Next, at_b) -> "Pause | None":
    """The rows at_b's pause policy reset for a new request (None: the engine does not speculate)."""
    if nxt.pause is None:
        return None
    return jax.tree.map(lambda x, y: _put_rows(x, at_b, y), nxt.pause, Pause.fresh(at_b.shape[0]))


def _logprobs(logits_BV, token_B):
    """(the chosen token's log-probability [B], the top MAX_TOP_LOGPROBS [B, k] and their ids)."""
    logp_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1)
    chosen_B = jnp.take_along_axis(logp_BV, token_B[:, None], axis=-1)[:, 0]
    top_Bk, ids_Bk = jax.lax.top_k(logp_BV, min(MAX_TOP_LOGPROBS, logp_BV.shape[-1]))
    return chosen_B, top_Bk, ids_Bk.astype(jnp.int32)


def _put_rows(into, rows_b, x):
    """`into` [B, ...] with rows rows_b [b] set to x [b, ...]; a row index of B or more is dropped
    (the padding rows of a prefill batch)."""
    return into.at[rows_b].set(x.astype(into.dtype), mode="drop")


def _insert_rows(cache: KVCache, fresh: KVCache, at_b) -> KVCache:
    """`cache` with rows at_b [b] (B or more: dropped) holding the b-row cache `fresh` in their
    first slots (every layer and int8 scale) and its bounds."""
    W = fresh.length

    def slots(big, small):
        return big.at[at_b, :, :W].set(small, mode="drop")
    many = lambda big, small: None if big is None else [slots(x, y) for x, y in zip(big, small, strict=True)]
    return cache.replace(k=many(cache.k, fresh.k), v=many(cache.v, fresh.v),
                         k_scale=many(cache.k_scale, fresh.k_scale), v_scale=many(cache.v_scale, fresh.v_scale),
                         start=_put_rows(cache.start, at_b, fresh.start), end=_put_rows(cache.end, at_b, fresh.end))


def _prefill_insert(params, rows: Rows, nxt: Next, tokens_bW, start_b, at_b, sampling_b: SamplingParams,
                    draft=None, *, kv_int8: bool):
    """Prefill b left-padded prompts of one bucket width W, sample each first token (index 0), and
    insert each row into the cache's row at_b (B: padding, dropped); with a `draft` model, its
    cache's rows too. Returns (rows, next, first tokens [b], logprobs)."""
    b, W = tokens_bW.shape
    kv_dtype = "int8" if kv_int8 else None
    fresh = init_cache(params.config, b, W, params.dtype, start_b, kv_dtype=kv_dtype)
    logits_bV, fresh = step(params, tokens_bW, fresh, fresh=True)
    return _insert_prompts(params, rows, nxt, logits_bV, fresh, tokens_bW, start_b, at_b, sampling_b, draft)


def _insert_prompts(params, rows: Rows, nxt: Next, logits_bV, fresh: KVCache, tokens_bW, start_b, at_b,
                    sampling_b: SamplingParams, draft=None):
    """What `_prefill_insert` does after the prefill made the prompts' last logits and fresh b-row
    cache: the draft model's prefill, each first token sampled, each row inserted."""
    cfg = params.config
    b, W = tokens_bW.shape
    draft_cache = rows.draft
    if draft is not None:
        kv_dtype = "int8" if fresh.k_scale is not None else None
        fresh_d = init_cache(draft.config, b, W, draft.dtype, start_b, kv_dtype=kv_dtype)
        _, fresh_d = step(draft, tokens_bW, fresh_d, fresh=True)
        draft_cache = _insert_rows(draft_cache, fresh_d, at_b)
    history = (seen_from_prompt(tokens_bW, start_b, cfg.vocab_size), jnp.zeros((b, cfg.vocab_size), jnp.int32))
    first_b = choose(logits_bV, history, sampling_b, 0, EVERY)
    logprobs = _logprobs(logits_bV, first_b)
    seen_bV, counts_bV = record(history, first_b, jnp.ones((b,), bool))
    cache = _insert_rows(rows.cache, fresh, at_b)
    seq = rows.seq
    if seq is not None:  # the padded prompt at slots [0, W), its first token pending at W
        seq = seq.at[at_b, :W].set(tokens_bW, mode="drop").at[at_b, W].set(first_b, mode="drop")
    rows = Rows(cache, _put_rows(rows.seen, at_b, seen_bV), _put_rows(rows.counts, at_b, counts_bV), seq,
                draft_cache)
    nxt = Next(_put_rows(nxt.tokens, at_b, first_b), _put_rows(nxt.index, at_b, jnp.ones((b,), jnp.int32)),
               jax.tree.map(lambda x, y: _put_rows(x, at_b, y), nxt.sampling, sampling_b), _put_pause(nxt, at_b))
    return rows, nxt, first_b, logprobs


def _chunk(params, stage: Rows, tokens_1C, start_1, draft=None, *, first: bool):
    """One chunk of a long prompt into the one-row staging cache (the first: fresh, its left padding
    before start_1), and into the draft model's if any; returns the staging state."""
    cfg = params.config
    cache, draft_cache = stage.cache, stage.draft
    if first:
        cache = cache.replace(start=start_1, end=jnp.zeros_like(cache.end))
        if draft is not None:
            draft_cache = draft_cache.replace(start=start_1, end=jnp.zeros_like(cache.end))
        seen = seen_from_prompt(tokens_1C, start_1, cfg.vocab_size)
    else:
        seen = stage.seen | seen_from_prompt(tokens_1C, jnp.zeros((1,), jnp.int32), cfg.vocab_size)
    seq = _put_chunk(stage.seq, tokens_1C, cache.end[0])
    _, cache = step(params, tokens_1C, cache, fresh=first)
    if draft is not None:
        _, draft_cache = step(draft, tokens_1C, draft_cache, fresh=first)
    return stage.replace(cache=cache, seen=seen, seq=seq, draft=draft_cache)


def _put_chunk(seq_1S, tokens_1C, at):
    """The staged row's tokens with a chunk's at slot `at` (None: the engine does not speculate)."""
    return None if seq_1S is None else jax.lax.dynamic_update_slice(seq_1S, tokens_1C, (0, at))


def _chunk_insert(params, rows: Rows, nxt: Next, stage: Rows, tokens_1C, at, sampling_1: SamplingParams,
                  draft=None):
    """The last chunk of a long prompt: run it on the staging cache (and the draft model's), sample
    the first token and insert the staged row into the cache's row `at` (traced). Returns (rows,
    next, first token [1], logprobs)."""
    cfg = params.config
    logits_1V, staged = step(params, tokens_1C, stage.cache)
    draft_cache = rows.draft
    if draft is not None:
        _, staged_d = step(draft, tokens_1C, stage.draft)
        draft_cache = insert(draft_cache, staged_d, at)
    history = (stage.seen | seen_from_prompt(tokens_1C, jnp.zeros((1,), jnp.int32), cfg.vocab_size),
               jnp.zeros((1, cfg.vocab_size), jnp.int32))
    first_1 = choose(logits_1V, history, sampling_1, 0, EVERY)
    logprobs = _logprobs(logits_1V, first_1)
    seen_1V, counts_1V = record(history, first_1, jnp.ones((1,), bool))
    at_1 = jnp.reshape(at, (1,))
    seq = rows.seq
    if seq is not None:  # the staged row's tokens, the last chunk's, and the first token pending
        seq_1S = _put_chunk(stage.seq, tokens_1C, stage.cache.end[0]).at[0, staged.end[0]].set(first_1[0], mode="drop")
        seq = jax.lax.dynamic_update_slice(seq, seq_1S, (jnp.asarray(at, jnp.int32), jnp.int32(0)))
    rows = Rows(insert(rows.cache, staged, at), _put_rows(rows.seen, at_1, seen_1V),
                _put_rows(rows.counts, at_1, counts_1V), seq, draft_cache)
    nxt = Next(_put_rows(nxt.tokens, at_1, first_1), _put_rows(nxt.index, at_1, jnp.ones((1,), jnp.int32)),
               jax.tree.map(lambda x, y: _put_rows(x, at_1, y), nxt.sampling, sampling_1), _put_pause(nxt, at_1))
    return rows, nxt, first_1, logprobs


def _release_free(cache: KVCache, active_n) -> tuple[KVCache, KVCache]:
    """(`cache` with the free rows among its first n = len(active_n) emptied (`release`), those n
    rows' bounds as a cache whose start and end are [n])."""
    n = active_n.shape[0]
    if n == cache.batch:
        cache = release(cache, ~active_n)
        return cache, cache
    free = release(cache.replace(start=cache.start[:n], end=cache.end[:n]), ~active_n)
    return cache.replace(start=cache.start.at[:n].set(free.start), end=cache.end.at[:n].set(free.end)), free


def _decode(params, rows: Rows, nxt: Next, active_n, rotation, *, flags: SamplingFlags, logprobs: bool):
    """One token for each of the cache's first n rows, n = len(active_n) (a decode bucket: the
    rows past it are neither read nor written); free rows among them are emptied first (they write
    slot 0 and read nothing). Returns (rows, next, tokens [n], logprobs or None)."""
    n = active_n.shape[0]
    cache, _ = _release_free(rows.cache, active_n)
    logits_nV, cache = step(params, nxt.tokens[:n, None], cache, rotation=rotation)
    return _decoded(rows.replace(cache=cache), nxt, logits_nV, active_n, flags=flags, logprobs=logprobs)


def _mixed(params, rows: Rows, nxt: Next, active_n, rotation, tokens_bW, start_b, at_b, sampling_b: SamplingParams,
           draft=None, *, flags: SamplingFlags):
    """`_decode` (without logprobs) and `_prefill_insert` in one pass of the target (`mixed_step`:
    each matrix reads its weights once for the decode rows and the prompts). The prompts' rows
    at_b are free rows: among the first n they decode as free rows do, then take the prompts.
    Returns (rows, next, tokens [n], first tokens [b], the prompts' logprobs)."""
    n = active_n.shape[0]
    cache, _ = _release_free(rows.cache, active_n)
    logits_nV, logits_bV, cache, fresh = mixed_step(params, nxt.tokens[:n], cache, tokens_bW, start_b, rotation)
    rows, nxt, token_n, _ = _decoded(rows.replace(cache=cache), nxt, logits_nV, active_n, flags=flags, logprobs=False)
    rows, nxt, first_b, lp = _insert_prompts(params, rows, nxt, logits_bV, fresh, tokens_bW, start_b, at_b,
                                             sampling_b, draft)
    return rows, nxt, token_n, first_b, lp


def _decoded(rows: Rows, nxt: Next, logits_nV, active_n, *, flags: SamplingFlags, logprobs: bool):
    """What `_decode` does after the step that wrote the cache (rows.cache) and made logits_nV."""
    B, n = rows.cache.batch, active_n.shape[0]
    first = (lambda x: x) if n == B else (lambda x: x[:n])
    put = (lambda full, part: part) if n == B else (lambda full, part: full.at[:n].set(part))
    cache = rows.cache
    history = (first(rows.seen), first(rows.counts))
    token_n = choose(logits_nV, history, jax.tree.map(first, nxt.sampling), first(nxt.index), flags)
    if not flags.greedy:  # the greedy program runs only while no running row reads a history
        history = record(history, token_n, active_n)
    seq = rows.seq
    if seq is not None:  # the new token pending at the row's new end
        seq = seq.at[jnp.arange(n), cache.end[:n]].set(token_n, mode="drop")
    rows = Rows(cache, put(rows.seen, history[0]), put(rows.counts, history[1]), seq, rows.draft)
    nxt = Next(put(nxt.tokens, token_n), put(nxt.index, first(nxt.index) + 1), nxt.sampling, nxt.pause)
    return rows, nxt, token_n, _logprobs(logits_nV, token_n) if logprobs else None


def _speculate(params, rows: Rows, nxt: Next, active_n, rotation, knobs, draft=None, *, flags: SamplingFlags,
               logprobs: bool, k: int, proposer: speculative.Proposer):
    """A speculative round for each of the cache's first n rows (a decode bucket, as `_decode`):
    up to k drafts (prompt lookup: from the row's own tokens; a `draft` model: k of its steps,
    after it catches up on the tokens its cache lacks), one target step over its pending token and
    them (k + 1 positions), the longest run the target accepts and its own next token kept, the
    rejected slots rolled back. A row without a draft keeps one token, as a plain step would.
    Returns (rows, next, tokens [n, k + 1] of which a row's first counts_n are new, (counts_n,
    drafts_n checked), logprobs [n, k + 1] or None).

    Each row pauses as generate's batch does (`knobs`: float32 [4], the bar its moving mean of
    kept tokens a round must reach, the mean's decay, the shortest and longest pause; a bar below
    0 never pauses): a paused row has no draft, so a row's rounds depend on its own tokens alone.

    When no running row has a draft the step is the plain one-token step (`_decode`), which costs
    less than a verify step over k + 1 positions, and a draft model does not run. The two are
    `while_loop`s of zero or one trip, whose carries XLA aliases, as in generate's loop: a
    `lax.cond` between them copied every layer's cache around it (CPU HLO), which a server's
    cache cannot afford."""
    B, n, J = rows.cache.batch, active_n.shape[0], k + 1
    first = (lambda x: x) if n == B else (lambda x: x[:n])
    put = (lambda full, part: part) if n == B else (lambda full, part: full.at[:n].set(part))
    cache, free = _release_free(rows.cache, active_n)
    token_n, index_n, sampling = first(nxt.tokens), first(nxt.index), jax.tree.map(first, nxt.sampling)
    history = (first(rows.seen), first(rows.counts))
    end_n = free.end  # the pending token's slot
    pause = jax.tree.map(first, nxt.pause)
    drafting_n = active_n & (index_n >= pause.resume)
    # A row's key by its token index, as a plain step's: its tokens do not depend on the batch
    keys_n = None if flags.greedy else speculative.round_keys(sampling.seed, index_n)
    draft_cache = rows.draft
    if draft is None:
        d_nK, valid_nK = proposer.drafts(first(rows.seq), free.start, end_n, token_n, k)
        valid_nK = valid_nK & drafting_n[:, None]
        go = jnp.any(valid_nK[:, 0])
    else:
        draft_cache, _ = _release_free(draft_cache, active_n)
        go = jnp.any(drafting_n)
    rows = rows.replace(cache=cache, draft=draft_cache)

    def verify(rows: Rows, nxt: Next):
        draft_cache, q_nKV = rows.draft, None
        if draft is None:
            d, valid = d_nK, valid_nK
        else:
            ctx = speculative.Context(first(rows.seq), 0, token_n, end_n + 1, jnp.int32(0), history, sampling, flags,
                                      jnp.zeros((n,), jnp.uint32) if keys_n is None else keys_n, k)
            (d, valid, q_nKV), draft_cache = proposer.propose(draft, draft_cache, ctx, k)
            valid = valid & drafting_n[:, None]
        raw_nJV, cache = step(params, jnp.concatenate([token_n[:, None], d], axis=1), rows.cache,
                              rotation=rotation, all_logits=True)
        logits_nJV = speculative.target_choices(raw_nJV, history, d, sampling, flags)
        accepted_n, x_n = speculative.judge(logits_nJV, d, valid, q_nKV, sampling, flags, keys_n)
        if not flags.greedy:  # a row without a draft draws as a plain step would, with its key
            x_n = jnp.where(valid[:, 0], x_n, choose(raw_nJV[:, 0], history, sampling, index_n, flags))
        j_J = jnp.arange(J, dtype=jnp.int32)
        emit_nJ = jnp.where(j_J[None] < accepted_n[:, None], jnp.concatenate([d, x_n[:, None]], axis=1),
                            x_n[:, None])
        kept_n = accepted_n + 1  # the pending token and the accepted drafts stay in the cache
        # the rows past the bucket roll back nothing (a [B] count: [n] broadcast over them, or failed)
        cache = rollback(cache, put(jnp.zeros_like(cache.end), speculative.rejected(J, kept_n)))
        if draft is not None:  # its slots past the target's end are stale: the next catch-up rewrites them
            draft_cache = proposer.commit(draft, draft_cache, cache.end[:n])
        keep_nJ = (j_J[None] < kept_n[:, None]) & active_n[:, None]
        h = history
        if not flags.greedy:
            for j in range(J):
                h = record(h, emit_nJ[:, j], keep_nJ[:, j])
        # d_1..d_n, x at the slots after the pending token's (S: past the row, dropped)
        cols_nJ = jnp.where(keep_nJ, end_n[:, None] + 1 + j_J[None], rows.seq.shape[1])
        seq = rows.seq.at[jnp.arange(n)[:, None], cols_nJ].set(emit_nJ, mode="drop")
        rows = Rows(cache, put(rows.seen, h[0]), put(rows.counts, h[1]), seq, draft_cache)
        policy = jax.tree.map(put, nxt.pause, _pause(pause, valid[:, 0], kept_n, index_n, knobs))
        nxt = Next(put(nxt.tokens, x_n), put(nxt.index, index_n + kept_n), nxt.sampling, policy)
        lp = _logprobs_J(raw_nJV, emit_nJ) if logprobs else None
        return rows, nxt, emit_nJ, (kept_n, jnp.sum(valid, axis=1, dtype=jnp.int32)), lp

    def plain(rows: Rows, nxt: Next):
        rows, nxt, token_n, lp = _decode(params, rows, nxt, active_n, rotation, flags=flags, logprobs=logprobs)
        spread = lambda x: jnp.broadcast_to(x[:, None], (n, J) + x.shape[1:])
        return rows, nxt, spread(token_n), (jnp.ones((n,), jnp.int32), jnp.zeros((n,), jnp.int32)), \
            None if lp is None else tuple(spread(x) for x in lp)

    top = min(MAX_TOP_LOGPROBS, params.config.vocab_size)
    zero = lambda shape, dtype=jnp.int32: jnp.zeros(shape, dtype)
    lp = (zero((n, J), jnp.float32), zero((n, J, top), jnp.float32), zero((n, J, top))) if logprobs else None
    out = (rows, nxt, zero((n, J)), (zero((n,)), zero((n,))), lp)
    once = lambda body: lambda s: (body(*s[0][:2]), jnp.bool_(True))
    out, _ = jax.lax.while_loop(lambda s: go & ~s[1], once(verify), (out, jnp.bool_(False)))
    out, _ = jax.lax.while_loop(lambda s: ~go & ~s[1], once(plain), (out, jnp.bool_(False)))
    return out


def _pause(pause: Pause, drafted_n, kept_n, index_n, knobs) -> Pause:
    """The rows' policy after a verify round in which drafted_n rows had drafts and kept kept_n
    tokens: a row whose moving mean falls below the bar pauses for its pause length (at least the
    shortest), which doubles, up to the longest, while the probe round after it fails."""
    bar, decay, shortest, longest = knobs[0], knobs[1], knobs[2].astype(jnp.int32), knobs[3].astype(jnp.int32)
    gain = kept_n.astype(jnp.float32)
    mean = jnp.where(pause.mean < 0, gain, decay * pause.mean + (1 - decay) * gain)
    pays = mean >= bar
    length = jnp.maximum(pause.length, shortest)
    return Pause(mean=jnp.where(drafted_n, jnp.where(pays, mean, -1.0), pause.mean),
                 resume=jnp.where(drafted_n & ~pays, index_n + kept_n + length, pause.resume),
                 length=jnp.where(drafted_n, jnp.where(pays, 0, jnp.minimum(2 * length, longest)), pause.length))


def _logprobs_J(logits_nJV, token_nJ):
    """`_logprobs` of each of J positions a row, as [n, J] (and [n, J, top]) arrays."""
    n, J, V = logits_nJV.shape
    chosen, top, ids = _logprobs(logits_nJV.reshape(n * J, V), token_nJ.reshape(n * J))
    return chosen.reshape(n, J), top.reshape(n, J, -1), ids.reshape(n, J, -1)


def _donated(*argnums) -> tuple[int, ...]:
    # CPU cannot donate buffers (and warns each call); on a GPU the cache is updated in place.
    return () if jax.default_backend() == "cpu" else argnums


_jitted: dict[str, dict] = {}


def _programs() -> dict:
    """The engine's jitted programs, one set a backend and process: engines of one model shape
    (a server restarted in-process, tests) share their compilations."""
    backend = jax.default_backend()
    if backend not in _jitted:
        _jitted[backend] = {
            "prefill": jax.jit(partial(_prefill_insert, kv_int8=False), donate_argnums=_donated(1)),
            "prefill_int8": jax.jit(partial(_prefill_insert, kv_int8=True), donate_argnums=_donated(1)),
            **{f"chunk_{first}": jax.jit(partial(_chunk, first=first), donate_argnums=_donated(1))
               for first in (True, False)},
            "chunk_insert": jax.jit(_chunk_insert, donate_argnums=_donated(1)),
            "decode": jax.jit(_decode, donate_argnums=_donated(1), static_argnames=("flags", "logprobs")),
            "mixed": jax.jit(_mixed, donate_argnums=_donated(1), static_argnames=("flags",)),
            "speculate": jax.jit(_speculate, donate_argnums=_donated(1),
                                 static_argnames=("flags", "logprobs", "k", "proposer")),
        }
    return _jitted[backend]


# --- the host side ---------------------------------------------------------------------------------


def speculative_spec(speculative_, num_speculative) -> speculative.Spec:
    """The engine's checked `speculative` and `num_speculative` (k drafts a round; None: the kind's
    default, and rows pause while their rounds do not pay): prompt lookup ("ngram"
    or an NGram), or a draft model (its Params, or a function that loads them); the draft's own
    checks (vocabulary, sharding) come in `start`, once both models are loaded."""
    ngram = isinstance(speculative_, speculative.NGram)
    if ngram or isinstance(speculative_, str) and speculative_ == "ngram":
        spec, _ = speculative.resolve(None, "ngram", num_speculative)
        return spec._replace(proposer=speculative_) if ngram else spec
    if isinstance(speculative_, Params) or callable(speculative_) and not isinstance(speculative_, type):
        draft = speculative.Draft(pair=speculative.current().draft_pair)
        return speculative.Spec(draft, speculative.drafts_a_round("draft", num_speculative),
                                adaptive=num_speculative is None)
    raise ValueError(f"the serving engine speculates by prompt lookup (speculative='ngram') or with a draft "
                     f"model (its Params), got {speculative_!r}")


@dataclass(eq=False)
class _Running:
    rid: int
    request: Request
    on_event: OnEvent
    stops: frozenset
    width: int  # the prompt's bucket width; 0: a long prompt, prefilled in chunks
    row: int = -1
    made: int = 0  # tokens emitted
    done: bool = False
    chunks: list = field(default_factory=list)  # a long prompt's chunks still to prefill
    chunked: int = 0  # and how many it has prefilled


@dataclass
class _Pending:
    """A dispatched call whose tokens the host has not read yet: the request of each of its rows
    as they were when it was dispatched (None: a free or padding row)."""

    owners: list
    tokens: jax.Array  # [b], or [b, k + 1] from a speculative step
    logprobs: tuple | None
    counts: tuple | None = None  # a speculative step's (new tokens [b], drafts checked [b])


def _sampling_values(requests: list[Request | None]) -> SamplingParams:
    """The rows' settings as numpy arrays (None: a padding row, greedy)."""
    neutral = Request((0,), 1)
    rs = [r or neutral for r in requests]
    config = SamplingConfig(*(tuple(getattr(r, name) for r in rs) for name in (
        "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
        "frequency_penalty", "seed")))
    return config.values(len(rs))


class BatchingEngine:
    """Continuous batching on one engine thread (see the module docstring)."""

    def __init__(self, params, *, max_slots: int = 8, max_context: int | None = None, max_queued: int = 64,
                 prefill_chunk: int = 512, prefill_batches: tuple[int, ...] = (1, 4, 16),
                 decode_rows: tuple[int, ...] = DECODE_ROWS, eos_token_ids=(), kv_dtype=None,
                 load: Callable[[], object] | None = None, time_device_every: int = 0,
                 speculative: str | speculative.NGram | Params | Callable[[], Params] | None = None,
                 num_speculative: int | None = None, mixed_prefill: bool = True):
        """`params` may be None with `load` given: `start()` calls `load()` for them (a server
        answers /health with 503 meanwhile). `max_slots` requests run at once, each up to
        `max_context` tokens (prompt + max_tokens; default and bound: the model's context);
        `max_queued` more wait. Prompts of more than `prefill_chunk` tokens (a bucket length: a
        power of two >= 16, or a multiple of 1024) are prefilled in chunks of that many between
        decode steps; shorter ones in batches of `prefill_batches` rows of one bucket width, as
        many rows as fit in `prefill_chunk` tokens. A decode step computes the first n rows of
        the cache, n the least of `decode_rows` (and max_slots) that holds every running row:
        requests take the lowest free row, so a lone stream runs batch-1 steps. A request stops
        at `eos_token_ids` and the model's own EOS ids unless it says `ignore_eos`. With
        `time_device_every` k > 0, one iteration in k runs its calls alone on an idle device and
        times them from the first call's launch (stats' device_s and device_iterations: what the
        device takes a step, to set against the loop's busy_s). With `mixed_prefill`, a step of
        the largest decode bucket that admits one short prompt prefills it in the same pass of
        the model as the decode rows (`mixed_step`; not with sharded params or where the bucket
        speculates).

        `speculative="ngram"` (or a `speculative.NGram`) speculates by prompt lookup, k =
        `num_speculative` drafts a row a step (default 7); a draft model's Params (or a function
        that loads them, called in `start` after `load`) by k (default 3) steps of the draft, which
        shares the target's vocabulary and keeps a cache of the same rows. Both in the decode
        buckets of at most `SpecTuning.batch_limit` rows (JAXLLM_SPEC_MAX_BATCH, ..._DRAFT); larger
        buckets decode plainly. Without `num_speculative` a row whose rounds keep too few tokens
        for their cost pauses, as generate's batch does (`SpecTuning`). Greedy rows get plain greedy's
        tokens; sampled rows the same law, the same tokens for a seed while the row's steps speculate
        (docs/decisions/serving.md#speculation-prompt-lookup-in-the-decode-step)."""
        for name, n in (("max_slots", max_slots), ("max_queued", max_queued), ("prefill_chunk", prefill_chunk)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {n!r}")
        if prefill_chunk < MIN_BUCKET or bucket(prefill_chunk) != prefill_chunk:
            raise ValueError(f"prefill_chunk must be a power of two >= {MIN_BUCKET} or a multiple of 1024, "
                             f"got {prefill_chunk}")
        for name, sizes in (("prefill_batches", prefill_batches), ("decode_rows", decode_rows)):
            if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes):
                raise ValueError(f"{name} must be whole numbers >= 1, got {sizes!r}")
        if max_context is not None and (isinstance(max_context, bool) or not isinstance(max_context, int)
                                        or max_context < 2):
            raise ValueError(f"max_context must be a whole number >= 2, got {max_context!r}")
        if params is None and load is None:
            raise ValueError("BatchingEngine needs params, or load to make them")
        self._spec = None
        if speculative is not None:
            self._spec = speculative_spec(speculative, num_speculative)
        elif num_speculative is not None:
            raise ValueError("num_speculative needs speculative='ngram' or a draft model")
        # the draft model, or what loads it (start() resolves it)
        self._draft = speculative if self._spec is not None and isinstance(self._spec.proposer, Draft) else None
        self._params, self._load = params, load
        self._eos = tuple(eos_token_ids)
        self.max_slots, self.max_context, self.max_queued = max_slots, max_context, max_queued
        self.prefill_chunk = prefill_chunk
        self._batches = tuple(sorted(set(b for b in prefill_batches if b <= max_slots) | {1}))
        self._decode_rows = tuple(sorted(set(n for n in decode_rows if n < max_slots) | {max_slots}))
        # The decode buckets that speculate (sharded params: none below max_slots, see _init_state)
        self._spec_rows = () if self._spec is None else tuple(
            n for n in self._decode_rows if n <= self._spec.tuning.batch_limit(self._spec.proposer))
        self._kv_dtype = kv_dtype
        self.mixed_prefill = bool(mixed_prefill)
        self.time_device_every = time_device_every
        self.on_failure: Callable[[str], None] | None = None
        self.on_progress: Callable[[str], None] | None = None
        self._cond = threading.Condition(threading.RLock())
        self._waiting: collections.deque[_Running] = collections.deque()
        self._aborts: set[int] = set()
        self._abort_all = False
        self._owner: list[_Running | None] = [None] * max_slots  # the request of each row
        self._staging: _Running | None = None  # the long prompt being prefilled in chunks
        self._chunk_turn = True  # whether its next chunk goes before short prompts' prefill
        self._pending: collections.deque[_Pending] = collections.deque()
        self._next_id = 0
        self._closing = False
        self._failed: str | None = None
        self._ready = False
        self._thread: threading.Thread | None = None
        self._compilations = 0
        # busy_s: the loop's time in iterations (waits on the device included, idle waits not), cpu_s
        # its thread's processor time; wait_s: its waits on the device's results; device_s: the
        # timed iterations' calls alone; spec_steps: verify steps in which some row had a draft;
        # spec_proposed and spec_accepted: drafts checked and kept, of the rows running when read
        self._counters = dict(iterations=0, decode_steps=0, prefill_calls=0, mixed_steps=0, chunk_calls=0, tokens=0,
                              occupied_rows=0, computed_rows=0, busy_s=0.0, cpu_s=0.0, wait_s=0.0, device_s=0.0,
                              device_iterations=0, spec_steps=0, spec_proposed=0, spec_accepted=0)
        global _listening
        if not _listening:
            jax.monitoring.register_event_duration_secs_listener(_count_compilation)
            _listening = True

    # --- the contract -------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._ready and self._failed is None and not self._closing

    def start(self) -> None:
        _counting.engine = self
        started = time.perf_counter()
        try:
            if self._params is None:
                self._say("loading the model")
                self._params = self._load()
                self._say(f"model loaded in {time.perf_counter() - started:.1f} s")
            if self._draft is not None:
                if self._params.tp is not None:
                    raise ValueError("the serving engine runs a draft model with unsharded params only")
                draft = self._draft if isinstance(self._draft, Params) else self._draft()
                spec, self._draft = speculative.resolve(self._params, draft, self._spec.k)  # checks the pair
                self._spec = spec._replace(tuning=self._spec.tuning, adaptive=self._spec.adaptive)
            self._knobs = None
            if self._spec is not None:  # `_pause`'s bar: a round must return its cost (never, with k fixed)
                t, spec = self._spec.tuning, self._spec
                bar = t.verify_cost + spec.proposer.step_cost * spec.k if spec.adaptive else -1.0
                self._knobs = np.array([bar, t.decay, t.min_pause, t.max_pause], np.float32)
            cfg = self._params.config
            context = cfg.max_position_embeddings
            self.max_context = min(self.max_context or context, context)
            # Left padding to a bucket (at most the chunk, and less than the prompt) sits before a row's
            # prompt; one more slot for the step that runs after a row's last token; a multiple of
            # 128 as the decode attention kernel's blocks want (kernels.decode_attention_mode).
            # Speculating, 2k more: the step read last may have made k tokens past max_tokens (the
            # device knows no limit), and the step after it writes k + 1 slots.
            length = self.max_context + min(self.prefill_chunk, self.max_context) + 1
            length += 2 * self._spec.k if self._spec else 0
            self._length = -(-length // 128) * 128
            self._stops = frozenset(self._eos) | frozenset(cfg.eos_token_ids)
            try:  # before the cache is allocated: an out-of-memory error would name no setting
                check_fit(self._params, self.max_slots, 1, self._length, self._kv_dtype)
            except ValueError as e:
                raise ValueError(f"{self.max_slots} slots of {self.max_context} tokens do not fit: {e} "
                                 f"(fewer slots or a shorter max_context would)") from None
            self._init_state()
            self._warm_up()
        finally:
            _counting.engine = None
        self.warmup_compilations = self._compilations
        self._thread = threading.Thread(target=self._loop, name="jaxllm-engine", daemon=True)
        self._ready = True
        self._thread.start()

    def _say(self, message: str) -> None:
        if self.on_progress is not None:
            self.on_progress(message)

    def submit(self, request: Request, on_event: OnEvent) -> int:
        check_fits(request, self.max_context)
        with self._cond:
            if self._closing or self._failed is not None or not self._ready:
                raise EngineClosed(self._failed or "the engine is not running")
            if len(self._waiting) >= self.max_queued:
                raise QueueFull(f"{len(self._waiting)} requests are waiting, the most this server queues")
            rid = self._next_id
            self._next_id += 1
            stops = frozenset(request.stop_token_ids) | (frozenset() if request.ignore_eos else self._stops)
            P = len(request.prompt)
            width = prompt_width(P) if P <= self.prefill_chunk else 0
            self._waiting.append(_Running(rid, request, on_event, stops, width))
            self._cond.notify()
        return rid

    def abort(self, request_id: int) -> None:
        with self._cond:
            for item in self._waiting:
                if item.rid == request_id:
                    self._waiting.remove(item)
                    item.done = True
                    item.on_event(Event(finish_reason="abort"))
                    return
            self._aborts.add(request_id)
            self._cond.notify()

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop admitting; let running and waiting requests finish for `timeout` seconds (None:
        until done), then abort what is left and join the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread is None:
            return
        self._thread.join(timeout)
        with self._cond:
            self._abort_all = True
            self._cond.notify()
        self._thread.join()
        # The cache is most of the device memory a caller may want back (the server's app, a
        # bench's next mode) while this object itself stays referenced.
        self._rows = self._next = self._stage = None
        self._pending.clear()

    def stats(self) -> dict:
        with self._cond:
            in_rows = sum(o is not None for o in self._owner)
            c = self._counters
            return dict(running=in_rows, waiting=len(self._waiting), slots_in_use=in_rows,
                        max_slots=self.max_slots, compilations=self._compilations,
                        warmup_compilations=getattr(self, "warmup_compilations", None), failed=self._failed,
                        **c, mean_occupancy=c["occupied_rows"] / max(c["decode_steps"], 1) / self.max_slots)

    # --- device state and programs ------------------------------------------------------------

    def _init_state(self) -> None:
        p, B = self._params, self.max_slots
        V = p.config.vocab_size
        seq = (lambda b: jnp.zeros((b, self._length), jnp.int32)) if self._spec else (lambda b: None)
        self._rows = Rows(init_cache(p.config, B, self._length, p.dtype, kv_dtype=self._kv_dtype),
                          jnp.zeros((B, V), bool), jnp.zeros((B, V), jnp.int32), seq(B))
        self._next = jax.device_put(Next(np.zeros((B,), np.int32), np.zeros((B,), np.int32),
                                         _sampling_values([None] * B), Pause.fresh(B) if self._spec else None))
        self._stage = Rows(init_cache(p.config, 1, self._length, p.dtype, kv_dtype=self._kv_dtype),
                           jnp.zeros((1, V), bool), jnp.zeros((1, 0), jnp.int32), seq(1))
        d = self._draft
        if d is not None:
            # a catch-up feeds a chunk past the target's end, a round k slots (a multiple of 128
            # for the decode attention kernel's blocks, as the target's)
            length = -(-(self._length + max(self._spec.proposer.chunk, self._spec.k)) // 128) * 128
            try:
                check_fit(d, B, 1, length, self._kv_dtype)
            except ValueError as e:
                raise ValueError(f"the draft model's cache of {B} slots does not fit beside the target's: {e}") from None
            self._rows = self._rows.replace(draft=init_cache(d.config, B, length, d.dtype, kv_dtype=self._kv_dtype))
            self._stage = self._stage.replace(
                draft=init_cache(d.config, 1, self._length, d.dtype, kv_dtype=self._kv_dtype))
        self._rotation = rotation_table(p.config, self._length) if p.tp is None else None
        if p.tp is not None:  # a sharded step computes every row
            self._decode_rows = (B,)
            self._spec_rows = tuple(n for n in self._spec_rows if n == B)
        # The decode buckets whose steps may carry a prompt (`_mixed`): the largest, where the
        # decode step's weights read is shared with the most rows; a `mixed_step` is unsharded.
        self._mixed_rows = (B,) if self.mixed_prefill and p.tp is None and B not in self._spec_rows else ()
        programs = _programs()
        self._prefill_fn = programs["prefill_int8" if is_int8(self._kv_dtype) else "prefill"]
        self._chunk_fns = {first: programs[f"chunk_{first}"] for first in (True, False)}
        self._chunk_insert_fn = programs["chunk_insert"]
        self._decode_fn = programs["decode"]
        self._mixed_fn = programs["mixed"]
        self._speculate_fn = programs["speculate"]

    def _widths(self) -> list[int]:
        widths, w = [], MIN_BUCKET
        while w <= min(self.prefill_chunk, bucket(self.max_context)):
            widths.append(w)
            w = prompt_width(w + 1)
        return widths

    def _batch_sizes(self, width: int) -> list[int]:
        """Prefill batch sizes for prompts of one bucket width: at most a chunk's tokens at once."""
        return [b for b in self._batches if b == 1 or b * width <= self.prefill_chunk]

    def _warm_up(self) -> None:
        """Run every program once on padding rows (dropped) and free rows: prefill for each width
        and batch size, the chunk programs, the four decode programs of each decode bucket (and
        the four speculative ones of each bucket that speculates), and a mixed step's two (greedy
        or every filter) for each width in each bucket that mixes. Says how far it is (`on_progress`)
        every 10 s: a GPU's cold start compiles for minutes."""
        B = self.max_slots
        pad = self._params.config.pad_id
        runs = []  # each runs one program once
        for width in self._widths():
            for b in self._batch_sizes(width):
                runs.append(partial(self._advance, self._prefill_fn, np.full((b, width), pad, np.int32),
                                    np.zeros((b,), np.int32), np.full((b,), B, np.int32),
                                    _sampling_values([None] * b), self._draft))
        if self.max_context > self.prefill_chunk:
            tokens = np.full((1, self.prefill_chunk), pad, np.int32)
            runs.append(partial(self._stage_chunk, True, tokens, np.zeros((1,), np.int32)))
            runs.append(partial(self._stage_chunk, False, tokens, None))
            # the stage as the two chunks leave it, read when this runs
            runs.append(lambda: self._advance(self._chunk_insert_fn, self._stage, tokens, np.int32(0),
                                              _sampling_values([None]), self._draft))
        for n in self._decode_rows:
            for flags in (GREEDY, EVERY):
                for logprobs in (False, True):
                    runs.append(partial(self._advance, self._decode_fn, np.zeros((n,), bool), self._rotation,
                                        flags=flags, logprobs=logprobs))
                    if n in self._spec_rows:
                        runs.append(partial(self._advance, self._speculate_fn, np.zeros((n,), bool), self._rotation,
                                            self._knobs, self._draft, flags=flags, logprobs=logprobs,
                                            k=self._spec.k, proposer=self._spec.proposer))
        for n in self._mixed_rows:
            for width in self._widths():
                for flags in (GREEDY, EVERY):
                    runs.append(partial(self._advance, self._mixed_fn, np.zeros((n,), bool), self._rotation,
                                        np.full((1, width), pad, np.int32), np.zeros((1,), np.int32),
                                        np.full((1,), B, np.int32), _sampling_values([None]), self._draft,
                                        flags=flags))
        self._say(f"compiling {len(runs)} programs")
        started = said = time.perf_counter()
        for i, run in enumerate(runs, 1):
            run()
            if time.perf_counter() - said >= 10 and i < len(runs):
                said = time.perf_counter()
                self._say(f"compiled {i} of {len(runs)} programs in {said - started:.0f} s")
        jax.block_until_ready(self._rows)
        self._say(f"compiled {len(runs)} programs in {time.perf_counter() - started:.1f} s "
                  f"({self._compilations} compilations)")

    def _advance(self, program, *args, **kwargs) -> None:
        """Run a program that takes and gives back (rows, next, ...) on the engine's state."""
        self._rows, self._next, *_ = program(self._params, self._rows, self._next, *args, **kwargs)

    def _stage_chunk(self, first: bool, tokens, start) -> None:
        """Prefill a chunk into the staging cache (`start`: the first chunk's padding, else None)."""
        self._stage = self._chunk_fns[first](self._params, self._stage, tokens, start, self._draft)

    # --- the engine thread --------------------------------------------------------------------

    def _idle(self) -> bool:
        return not (self._waiting or self._staging or self._pending or self._aborts
                    or any(o is not None for o in self._owner))

    def _loop(self) -> None:
        _counting.engine = self
        try:
            while True:
                started, cpu = time.perf_counter(), time.thread_time()
                with self._cond:
                    if self._idle() and not self._closing:
                        while self._idle() and not self._closing:
                            self._cond.wait()
                        started, cpu = time.perf_counter(), time.thread_time()
                    if self._idle():  # closing and nothing left
                        return
                    self._take_aborts()
                    admitted = self._admit()
                self._iterate(admitted)
                self._counters["iterations"] += 1
                self._counters["busy_s"] += time.perf_counter() - started
                self._counters["cpu_s"] += time.thread_time() - cpu
        except BaseException:
            self._fail(traceback.format_exc(limit=6))

    def _take_aborts(self) -> None:
        """Under the lock: end aborted requests (all of them after shutdown's timeout) and free
        their rows before the next dispatch."""
        if self._abort_all:
            for item in self._waiting:
                item.done = True
                item.on_event(Event(finish_reason="abort"))
            self._waiting.clear()
        for item in [*self._owner, self._staging]:
            if item is not None and (self._abort_all or item.rid in self._aborts):
                self._end(item, Event(finish_reason="abort"))
        self._aborts.clear()

    def _end(self, item: _Running, event: Event) -> None:
        item.done = True
        if self._owner[item.row] is item:
            self._owner[item.row] = None
        if self._staging is item:
            self._staging = None
        item.on_event(event)

    def _admit(self) -> list[_Running]:
        """Under the lock: the requests to prefill now. The first waiting request (a long one
        starts staging) and, behind it, waiting requests of its bucket width, up to the largest
        batch size that fits the free rows. While a long prompt stages, its chunks take every
        other iteration, short prompts the others: neither waits for the other to finish."""
        if not self._waiting or self._staging is not None and self._chunk_turn:
            return []
        free = [r for r, o in enumerate(self._owner) if o is None]
        if not free:
            return []
        # Scans stop at what they need: a thousand requests may wait at saturation.
        head = self._waiting[0] if self._staging is None else next((w for w in self._waiting if w.width), None)
        if head is None:
            return []
        if not head.width:
            P = len(head.request.prompt)
            self._waiting.popleft()
            C = self.prefill_chunk
            width = -(-P // C) * C
            tokens = np.full((width,), self._params.config.pad_id, np.int32)
            tokens[width - P:] = head.request.prompt
            head.chunks = [tokens[i:i + C] for i in range(0, width, C)]
            head.row = free[0]
            self._owner[head.row] = head
            self._staging = head
            return [head]
        room = min(max(self._batch_sizes(head.width)), len(free))
        taken = list(itertools.islice((w for w in self._waiting if w.width == head.width), room))
        for item, row in zip(taken, free):
            self._waiting.remove(item)
            item.row = row
            self._owner[row] = item
        return taken

    def _iterate(self, admitted: list[_Running]) -> None:
        """Dispatch this iteration's prefill (or chunk) and decode step, or one mixed step of both,
        then read every call but the newest, which runs while the host works."""
        every = self.time_device_every
        timed = every > 0 and self._counters["iterations"] % every == 0
        if timed:  # the device idle first, so that the clock sees this iteration's calls alone
            while self._pending:
                self._deliver(self._pending.popleft())
        # The device starts a call about when its dispatch returns: the clock starts there, so
        # the host's dispatch of the first call is not counted as device time.
        launched = None
        prompts = admitted if admitted and admitted[0] is not self._staging else []
        if not prompts and self._staging is not None:
            self._prefill_chunk(self._staging)
            self._chunk_turn = False
            launched = time.perf_counter()
        active = np.array([o is not None and self._staging is not o for o in self._owner])
        newest = 1  # the calls left unread while the host works: the newest's results
        if prompts:
            self._chunk_turn = True
            mixed = self._mixed_step(prompts, active)
            if mixed:
                newest, active = 2, np.zeros_like(active)  # its decode rows done
            else:
                self._prefill(prompts)
            launched = time.perf_counter()
        if active.any():
            n, active, flags, logprobs, owners = self._decode_rows_of(active)
            if n in self._spec_rows:
                self._rows, self._next, tokens, counts, lp = self._speculate_fn(
                    self._params, self._rows, self._next, active, self._rotation, self._knobs, self._draft, flags=flags,
                    logprobs=logprobs,
                    k=self._spec.k, proposer=self._spec.proposer)
                self._pending.append(_Pending(owners, tokens, lp, counts))
            else:
                self._rows, self._next, tokens, lp = self._decode_fn(
                    self._params, self._rows, self._next, active, self._rotation, flags=flags, logprobs=logprobs)
                self._pending.append(_Pending(owners, tokens, lp))
            self._counted(active, n)
            launched = launched or time.perf_counter()
        elif newest == 1:
            newest = 0
        if timed and launched is not None:
            jax.block_until_ready((self._stage, [p.tokens for p in self._pending]))
            self._counters["device_s"] += time.perf_counter() - launched
            self._counters["device_iterations"] += 1
        while len(self._pending) > newest:
            self._deliver(self._pending.popleft())

    def _decode_rows_of(self, active):
        """A decode step's bucket n (the least that holds every row in `active`), active's first n,
        its sampling flags, whether it makes logprobs, and each of the n rows' request or None."""
        n = next(n for n in self._decode_rows if n > np.flatnonzero(active)[-1])
        active = active[:n]
        requests = [o.request for o, a in zip(self._owner, active) if a]
        flags = EVERY if any(r.temperature > 0 or r.repetition_penalty != 1 or r.presence_penalty != 0
                             or r.frequency_penalty != 0 for r in requests) else GREEDY
        logprobs = any(r.logprobs is not None for r in requests)
        return n, active, flags, logprobs, [o if a else None for o, a in zip(self._owner, active)]

    def _counted(self, active, n: int) -> None:
        self._counters["decode_steps"] += 1
        self._counters["occupied_rows"] += int(active.sum())
        self._counters["computed_rows"] += n

    def _mixed_step(self, prompts: list[_Running], active) -> bool:
        """Dispatch one mixed step (`_mixed`) for the decode rows in `active` but the prompt's and
        the one short prompt, where the rows' bucket mixes and no row asks for logprobs; False
        (nothing dispatched) otherwise."""
        if len(prompts) != 1 or not self._mixed_rows:
            return False
        (item,) = prompts
        running = active.copy()
        running[item.row] = False
        if not running.any():
            return False
        n, running, flags, logprobs, owners = self._decode_rows_of(running)
        if n not in self._mixed_rows or logprobs:
            return False
        tokens, start, at = self._prompt_rows(prompts, item.width, 1)
        self._rows, self._next, tokens_n, first, lp = self._mixed_fn(
            self._params, self._rows, self._next, running, self._rotation, tokens, start, at,
            _sampling_values([item.request]), self._draft, flags=flags)
        self._pending.append(_Pending([item], first, lp))
        self._pending.append(_Pending(owners, tokens_n, None))
        self._counters["prefill_calls"] += 1
        self._counters["mixed_steps"] += 1
        self._counted(running, n)
        return True

    def _prompt_rows(self, items: list[_Running], width: int, b: int):
        """b prompt rows of one bucket width: the left-padded tokens [b, width], each one's
        padding (start) and its cache row (at; max_slots: a padding row, dropped)."""
        tokens = np.full((b, width), self._params.config.pad_id, np.int32)
        start = np.zeros((b,), np.int32)
        at = np.full((b,), self.max_slots, np.int32)
        for j, item in enumerate(items):
            P = len(item.request.prompt)
            tokens[j, width - P:] = item.request.prompt
            start[j], at[j] = width - P, item.row
        return tokens, start, at

    def _prefill(self, items: list[_Running]) -> None:
        width = prompt_width(max(len(i.request.prompt) for i in items))
        b = min(s for s in self._batch_sizes(width) if s >= len(items))
        tokens, start, at = self._prompt_rows(items, width, b)
        self._rows, self._next, first, lp = self._prefill_fn(
            self._params, self._rows, self._next, tokens, start, at,
            _sampling_values([i.request for i in items] + [None] * (b - len(items))), self._draft)
        self._pending.append(_Pending(list(items) + [None] * (b - len(items)), first, lp))
        self._counters["prefill_calls"] += 1

    def _prefill_chunk(self, item: _Running) -> None:
        tokens = item.chunks.pop(0)[None]
        if item.chunks:
            first = item.chunked == 0
            item.chunked += 1
            P = len(item.request.prompt)
            start = np.array([-P % self.prefill_chunk], np.int32)
            self._stage_chunk(first, tokens, start if first else None)
            self._counters["chunk_calls"] += 1
            return
        self._rows, self._next, first, lp = self._chunk_insert_fn(
            self._params, self._rows, self._next, self._stage, tokens, np.int32(item.row),
            _sampling_values([item.request]), self._draft)
        with self._cond:
            if self._staging is item:
                self._staging = None
        self._pending.append(_Pending([item], first, lp))
        self._counters["chunk_calls"] += 1

    def _deliver(self, pending: _Pending) -> None:
        """Read one call's tokens (one device_get) and give each row's request its event."""
        waited = time.perf_counter()
        tokens, lp, counts = jax.device_get((pending.tokens, pending.logprobs, pending.counts))
        self._counters["wait_s"] += time.perf_counter() - waited
        if counts is not None:
            return self._deliver_runs(pending.owners, tokens.tolist(), lp, *(c.tolist() for c in counts))
        tokens, delivered = tokens.tolist(), 0  # Python ints at once, not one numpy scalar a row
        with self._cond:
            for j, item in enumerate(pending.owners):
                if item is None or item.done:
                    continue
                token = tokens[j]
                logprobs = None
                if item.request.logprobs is not None:
                    k = item.request.logprobs
                    chosen, top, ids = (x[j] for x in lp)
                    logprobs = [TokenLogprob(token, float(chosen), tuple(
                        (int(t), float(p)) for t, p in zip(ids[:k], top[:k])))]
                item.made += 1
                delivered += 1
                finish = "stop" if token in item.stops else \
                    "length" if item.made == item.request.max_tokens else None
                if finish:
                    self._end(item, Event([token], logprobs, finish))
                else:
                    item.on_event(Event([token], logprobs))
            self._counters["tokens"] += delivered

    def _deliver_runs(self, owners, tokens, lp, kept, drafted) -> None:
        """A speculative step's events: each row's kept tokens in one, up to a stop token or
        max_tokens (the row ends there; what the device made past it is never shown)."""
        delivered = proposed = accepted = 0
        with self._cond:
            for j, item in enumerate(owners):
                if item is None or item.done:
                    continue
                proposed += drafted[j]
                accepted += kept[j] - 1
                run, finish = tokens[j][:kept[j]], None
                for i, token in enumerate(run):
                    item.made += 1
                    finish = "stop" if token in item.stops else \
                        "length" if item.made == item.request.max_tokens else None
                    if finish:
                        run = run[:i + 1]
                        break
                logprobs = None
                if item.request.logprobs is not None:
                    k = item.request.logprobs
                    chosen, top, ids = (x[j] for x in lp)
                    logprobs = [TokenLogprob(token, float(chosen[i]), tuple(
                        (int(t), float(p)) for t, p in zip(ids[i][:k], top[i][:k]))) for i, token in enumerate(run)]
                delivered += len(run)
                if finish:
                    self._end(item, Event(run, logprobs, finish))
                else:
                    item.on_event(Event(run, logprobs))
            c = self._counters
            c["tokens"] += delivered
            c["spec_steps"] += any(drafted)
            c["spec_proposed"] += proposed
            c["spec_accepted"] += accepted

    def _fail(self, error: str) -> None:
        with self._cond:
            self._failed = error.strip().splitlines()[-1] or "engine failed"
            self._ready = False
            open_requests = [*self._waiting, *(o for o in self._owner if o is not None)]
            self._waiting.clear()
            self._owner = [None] * self.max_slots
            self._staging = None
            self._pending.clear()
            for item in open_requests:
                if not item.done:
                    item.done = True
                    item.on_event(Event(finish_reason="error", error=self._failed))
        if self.on_failure is not None:
            self.on_failure(self._failed)
