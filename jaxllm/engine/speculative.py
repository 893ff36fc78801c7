"""Speculative decoding: propose k tokens a row, check them with one target step over k+1
positions, keep the longest run the target agrees with, all inside one jitted loop.

A verify round, per row: the pending token x (emitted, not yet in the cache) and drafts
d_1..d_k go through `step(..., all_logits=True)` at the row's end; the target's distributions
p_0..p_k (after the same penalties and filters as plain decoding, each on its own prefix) decide
how many drafts n stay (greedy: those equal to the argmax; sampling: Leviathan et al.'s rule,
accept d_j with probability min(1, p/q), on the first rejection draw from norm(max(0, p - q)),
after k acceptances a bonus token from p_k); the row then emits d_1..d_n and one target token,
and `rollback` drops the k - n rejected cache slots, which the next round overwrites. Greedy
output equals plain greedy token for token; sampled output has the target's law, not plain
sampling's tokens for a seed.

The loop alternates two inner loops: verify rounds while the next round has a draft, and plain
one-token steps (generate's own step and pick) while it has none, because no row's last tokens
match anything (prompt lookup) or because speculation is paused (adaptive k: a batch whose verify
rounds return fewer tokens than they cost pauses for a number of plain steps that doubles while
the probe after it fails; a draft model also runs fewer steps while its acceptance is low).
After each step a cheap test (`Proposer.ready`) decides which loop runs next, so a plain step
pays only that test beside its step: no branch, no proposal.

Proposers: `NGram` (prompt lookup: the tokens after the latest earlier occurrence of the row's
last n tokens in its prompt and output; q is one-hot) and `Draft` (a second model sharing the
vocabulary, its own cache, run k steps; q is its filtered distribution; it skips plain steps and
catches up on their tokens at its next proposal).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.checks import whole
from jaxllm.engine.sampling import SamplingFlags, SamplingParams, argmax, choose, filter_logits, penalize, \
    penalty_history, record, row_keys
from jaxllm.env import env_flag, env_ints, env_number
from jaxllm.model.cache import KVCache, init_cache, rollback
from jaxllm.model.params import Params, param_bytes
from jaxllm.model.transformer import rotation_table, step

DEFAULT_K = {"ngram": 7, "draft": 3}
# The decode attention kernels take caches in whole blocks of slots (a multiple of 16, 64-slot
# blocks where the length allows: docs/decisions/decode-attention.md#tiles): the target's and the
# draft's caches of a speculative run are rounded up to this.
SPEC_CACHE_MULTIPLE = 64


def whole_blocks(slots: int) -> int:
    """slots rounded up to SPEC_CACHE_MULTIPLE."""
    return -(-slots // SPEC_CACHE_MULTIPLE) * SPEC_CACHE_MULTIPLE


@dataclasses.dataclass(frozen=True)
class SpecTuning:
    """When speculation runs: the batch policy of the default and adaptive k's pauses. Hashable
    (part of the loop's static `Spec`); the figures behind the defaults are in
    docs/decisions/speculative.md#when-it-runs."""

    # The default (num_speculative None) speculates for at most this many rows with prompt lookup
    # or a draft model; a larger batch decodes plainly, as a verify step over B * (k + 1) tokens
    # stops being nearly free (where, measured: docs/decisions/speculative.md#when-it-runs).
    max_batch: int = 4
    max_batch_draft: int = 64
    # A verify step's time in plain steps: a batch keeps speculating while its moving mean of
    # tokens a live row gains a verify round is at least this (plus a draft model's steps).
    verify_cost: float = 1.5
    decay: float = 0.8  # the moving mean's weight of the past
    min_pause: int = 4  # plain steps after a verify round that did not pay
    max_pause: int = 64  # the pause doubles while the probe round after it fails, up to this
    draft_pair: bool = True  # `Draft.pair`: a missing token rides in the proposal's first step

    @classmethod
    def from_env(cls) -> "SpecTuning":
        """The defaults, overridden by JAXLLM_SPEC_MAX_BATCH, JAXLLM_SPEC_MAX_BATCH_DRAFT,
        JAXLLM_SPEC_VERIFY_COST, JAXLLM_SPEC_PAUSE ("min,max") and JAXLLM_SPEC_DRAFT_PAIR."""
        d = cls()
        low, high = env_ints("JAXLLM_SPEC_PAUSE", f"{d.min_pause},{d.max_pause}")
        return cls(max_batch=env_number("JAXLLM_SPEC_MAX_BATCH", d.max_batch),
                   max_batch_draft=env_number("JAXLLM_SPEC_MAX_BATCH_DRAFT", d.max_batch_draft),
                   verify_cost=env_number("JAXLLM_SPEC_VERIFY_COST", d.verify_cost, float),
                   min_pause=max(low, 1), max_pause=max(high, low, 1),
                   draft_pair=env_flag("JAXLLM_SPEC_DRAFT_PAIR", d.draft_pair))

    def batch_limit(self, proposer: "Proposer") -> int:
        """The most rows the default speculates for with this proposer."""
        return self.max_batch_draft if isinstance(proposer, Draft) else self.max_batch


TUNING = SpecTuning.from_env()


def current() -> SpecTuning:
    """The process's tuning (`TUNING`, which tests and bench may replace)."""
    return TUNING


class SpecStats(NamedTuple):
    """What speculation did in one generate call (counts over live rows, host ints)."""

    k: int  # drafts proposed per verify round
    rounds: int  # target steps after the prefill (verify and plain)
    verify_rounds: int  # of which verify steps over k+1 positions
    row_rounds: int  # target steps summed over the rows still live in them
    drafted: int  # drafts checked (a row's round without a match drafts fewer than k)
    accepted: int
    histogram: tuple[int, ...]  # [k+1]: a live row's verify round accepting n drafts
    tokens: int  # tokens made after the prefill's first, summed over rows
    off_at_batch: bool = False  # the default's batch policy decoded plainly (SpecTuning.batch_limit)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """New tokens per target step per row (1.0 without speculation)."""
        return self.tokens / self.row_rounds if self.row_rounds else 0.0

    def as_dict(self) -> dict:
        return {**self._asdict(), "histogram": list(self.histogram),
                "acceptance_rate": round(self.acceptance_rate, 4),
                "tokens_per_step": round(self.tokens_per_step, 4)}


class Context(NamedTuple):
    """What a proposer may read in a round (traced): the padded prompts then the output so far
    [B, width + W] (count_B output tokens a row, the last one, token_B, pending: not yet in the
    target's cache, at column width + count_B - 1, which is also its cache slot), the round
    index, the penalties' history, the sampling settings, each row's round key, and how many of
    the k drafts the round wants (adaptive k; the rest are not checked)."""

    seq_BS: jax.Array
    width: int  # static: the padded prompt's width
    token_B: jax.Array
    count_B: jax.Array
    round: jax.Array
    history: tuple
    sampling: SamplingParams
    flags: SamplingFlags
    keys_B: jax.Array
    limit: jax.Array | int

    @property
    def end_B(self):
        """The target cache's end: the pending token's slot and column."""
        return self.width + self.count_B - 1


class Proposal(NamedTuple):
    d_BK: jax.Array  # int32 drafts
    valid_BK: jax.Array  # bool: a draft exists there (a run of trues from the left)
    q_BKV: jax.Array | None  # the law each draft was drawn from; None: one-hot (deterministic)


class Proposer:
    """How drafts are made. `aux` is the proposer's traced data (a draft's params), `state` what
    it carries between rounds; plain steps leave the state alone. `step_cost`: a draft's cost in
    the target's plain steps (0: drafts are free, every round proposes k)."""

    step_cost = 0.0

    def init(self, aux, tokens_BT, start_B, cache_length: int, kv_int8: bool):
        return ()

    def ready(self, aux, state, ctx: Context):
        """bool [B]: the row would have a draft now. Run after every step, plain ones included,
        so it must cost little; where no live row is ready the next step is a plain one."""
        return jnp.ones(ctx.count_B.shape, bool)

    def propose(self, aux, state, ctx: Context, k: int) -> tuple[Proposal, object]:
        raise NotImplementedError

    def commit(self, aux, state, end_B):
        """After a verify round: the target's cache now ends at end_B (the new pending token's
        slot)."""
        return state


def _ngram_ok(seq_BS, start_B, last_B, tail_B, n: int, match_BS=None):
    """Where the n tokens ending at each column equal the row's last n (the n-th last tail_B),
    inside the row (from its start) and before its last column; `match_BS` the test for n - 1."""
    S = seq_BS.shape[1]
    i_S = jnp.arange(S, dtype=jnp.int32)
    m = n - 1
    shifted_BS = seq_BS if m == 0 else jnp.pad(seq_BS, ((0, 0), (m, 0)), constant_values=-1)[:, :S]
    match_BS = (shifted_BS == tail_B[:, None]) if match_BS is None else match_BS & (shifted_BS == tail_B[:, None])
    ok_BS = match_BS & (i_S[None] - m >= start_B[:, None]) & (i_S[None] < last_B[:, None]) & \
        (last_B - m >= start_B)[:, None]
    return match_BS, ok_BS


@dataclasses.dataclass(frozen=True)
class NGram(Proposer):
    """Prompt lookup: match the row's last n tokens (longest n in [min_n, max_n] first) against
    its earlier tokens, latest match first, and propose the tokens that followed."""

    max_n: int = 3
    # One matching token is weak evidence: SmolLM2's answers to chat, code and summary prompts
    # (replayed offline) verified more for less with it (docs/decisions/speculative.md#when-it-runs)
    min_n: int = 2

    def init(self, aux, tokens_BT, start_B, cache_length, kv_int8):
        return start_B

    def ready(self, aux, start_B, ctx):
        return self.matches(ctx.seq_BS, start_B, ctx.end_B, ctx.token_B)

    def propose(self, aux, start_B, ctx, k):
        d_BK, valid_BK = self.drafts(ctx.seq_BS, start_B, ctx.end_B, ctx.token_B, k)
        return Proposal(d_BK, valid_BK, None), start_B

    # On arrays alone, so that the serving engine runs them on its rows: seq_BS holds each row's
    # tokens from start_B, the last one, token_B, at column last_B.

    def matches(self, seq_BS, start_B, last_B, token_B):
        """bool [B]: a match of min_n tokens exists (a longer one implies it): one reduction over
        [B, S]."""
        rows = jnp.arange(seq_BS.shape[0])
        match_BS = None
        for n in range(1, self.min_n + 1):
            tail_B = token_B if n == 1 else seq_BS[rows, jnp.maximum(last_B - n + 1, 0)]
            match_BS, ok_BS = _ngram_ok(seq_BS, start_B, last_B, tail_B, n, match_BS)
        return jnp.any(ok_BS, axis=1)

    def drafts(self, seq_BS, start_B, last_B, token_B, k: int):
        """(drafts [B, k], valid [B, k]): the k tokens after the latest match of the longest n."""
        B, S = seq_BS.shape
        i_S = jnp.arange(S, dtype=jnp.int32)
        rows = jnp.arange(B)
        best_B = jnp.full((B,), -1, jnp.int32)
        match_BS = None
        for n in range(1, self.max_n + 1):
            tail_B = token_B if n == 1 else seq_BS[rows, jnp.maximum(last_B - n + 1, 0)]
            match_BS, ok_BS = _ngram_ok(seq_BS, start_B, last_B, tail_B, n, match_BS)
            if n >= self.min_n:
                at_B = jnp.max(jnp.where(ok_BS, i_S[None], -1), axis=1)  # the latest match
                best_B = jnp.where(at_B >= 0, at_B, best_B)  # a longer n overrides
        j_K = jnp.arange(1, k + 1, dtype=jnp.int32)
        at_BK = best_B[:, None] + j_K[None]
        valid_BK = (best_B[:, None] >= 0) & (at_BK <= last_B[:, None])
        d_BK = jnp.take_along_axis(seq_BS, jnp.clip(at_BK, 0, S - 1), axis=1)
        return jnp.where(valid_BK, d_BK, 0), valid_BK


@dataclasses.dataclass(frozen=True)
class Draft(Proposer):
    """A draft model sharing the target's vocabulary: its own cache (the same slots), k steps a
    round drawing from its own filtered distribution. Plain steps do not run it: a proposal first
    feeds it the tokens its cache lacks (the plain steps' and a fully accepted round's last
    draft), `chunk` at a time while more than one is missing. It runs `ctx.limit` steps; with
    `pair`, a last missing token rides in the first of them, a step of two tokens a row, instead
    of a one-token step of its own (docs/decisions/speculative.md#where-a-rounds-time-goes)."""

    chunk: int = 8
    step_cost: float = 0.0
    pair: bool = True

    def init(self, aux, tokens_BT, start_B, cache_length, kv_int8):
        # a catch-up feeds a chunk past the target's end; whole blocks, or every draft step would
        # leave the attention kernel
        cache = init_cache(aux.config, tokens_BT.shape[0], whole_blocks(cache_length + self.chunk), aux.dtype,
                           start_B, kv_dtype="int8" if kv_int8 else None)
        _, cache = step(aux, tokens_BT, cache, fresh=True)
        return cache

    def catch_up(self, aux, cache: KVCache, seq_BS, end_B) -> KVCache:
        """The cache fed seq_BS's columns from its end to end_B (exclusive), the same slots; with
        `pair`, all but the last, which the proposal's first step feeds (`_first_step`). With
        fewer rows in seq_BS than in the cache (a serving engine's decode bucket), its first rows."""
        S = seq_BS.shape[1]
        rotation = rotation_table(aux.config, cache.length) if aux.tp is None else None
        ends = _first_rows(cache, end_B)

        def feed(cache, T):
            i_BT = ends(cache.end)[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
            tokens_BT = jnp.take_along_axis(seq_BS, jnp.clip(i_BT, 0, S - 1), axis=1)
            _, cache = step(aux, tokens_BT, cache, rotation=rotation if T == 1 else None)
            extra_B = T - jnp.clip(end_B - (ends(cache.end) - T), 0, T)  # what was not missing
            return rollback(cache, _as_rows(cache, extra_B))

        cache = jax.lax.while_loop(lambda c: jnp.max(end_B - ends(c.end)) > 1, lambda c: feed(c, self.chunk), cache)
        if self.pair:  # the last one rides in the proposal's first step
            return cache
        return jax.lax.while_loop(lambda c: jnp.any(end_B > ends(c.end)), lambda c: feed(c, 1), cache)

    def _first_step(self, aux, cache: KVCache, ctx: Context, rotation):
        """(logits [n, V] after the pending token, cache) of a caught-up cache that may lack one
        token a row, the one before the pending token: where any row lacks it, one step of two
        tokens a row (the missing one and the pending one; a row lacking none feeds its pending
        token twice and drops the second), else a one-token step. Two loops that run at most once,
        not a cond, which would copy the cache (docs/decisions/speculative.md)."""
        seq_BS, end_B, token_B = ctx.seq_BS, ctx.end_B, ctx.token_B
        ends = _first_rows(cache, end_B)
        missing_B = jnp.clip(end_B - ends(cache.end), 0, 1).astype(jnp.int32)  # 0 or 1 after the catch-up
        prev_B = jnp.take_along_axis(seq_BS, jnp.clip(end_B - 1, 0, seq_BS.shape[1] - 1)[:, None], axis=1)[:, 0]
        logits_BV = jnp.zeros((token_B.shape[0], aux.config.vocab_size), jnp.float32)

        def pair(carry):
            _, cache, _ = carry
            tokens_B2 = jnp.stack([jnp.where(missing_B > 0, prev_B, token_B), token_B], axis=1)
            logits_B2V, cache = step(aux, tokens_B2, cache, all_logits=True)
            logits_BV = jnp.take_along_axis(logits_B2V, missing_B[:, None, None], axis=1)[:, 0]
            return jnp.bool_(True), rollback(cache, _as_rows(cache, 1 - missing_B)), logits_BV.astype(jnp.float32)

        def single(carry):
            _, cache, _ = carry
            logits_BV, cache = step(aux, token_B[:, None], cache, rotation=rotation)
            return jnp.bool_(True), cache, logits_BV.astype(jnp.float32)

        carry = jax.lax.while_loop(lambda c: ~c[0] & jnp.any(missing_B > 0), pair, (jnp.bool_(False), cache, logits_BV))
        _, cache, logits_BV = jax.lax.while_loop(lambda c: ~c[0], single, carry)
        return logits_BV, cache

    def propose(self, aux, cache, ctx, k):
        cache = self.catch_up(aux, cache, ctx.seq_BS, ctx.end_B)
        rotation = rotation_table(aux.config, cache.length) if aux.tp is None else None
        flags = ctx.flags

        B, V = ctx.token_B.shape[0], aux.config.vocab_size

        def pick(j, logits_BV, history, d_BK, q_BKV):
            logits_BV = penalize(logits_BV, history, ctx.sampling, flags)
            if flags.greedy:
                d_B = argmax(logits_BV)
            else:
                q_BV = probs(logits_BV, ctx.sampling, flags)
                d_B = race(jax.vmap(lambda key: jax.random.fold_in(key, 100 + j))(ctx.keys_B), q_BV)
                q_BKV = jax.lax.dynamic_update_slice(q_BKV, q_BV[:, None], (0, j, 0))
            d_BK = jax.lax.dynamic_update_slice(d_BK, d_B[:, None], (0, j))
            return d_B, record(history, d_B, jnp.ones_like(d_B, bool)), d_BK, q_BKV

        def one(carry):
            j, token_B, cache, history, d_BK, q_BKV = carry
            logits_BV, cache = step(aux, token_B[:, None], cache, rotation=rotation)
            d_B, history, d_BK, q_BKV = pick(j, logits_BV, history, d_BK, q_BKV)
            return j + 1, d_B, cache, history, d_BK, q_BKV

        # `limit` steps write the pending token and d_1..d_{limit-1}; the last draft waits for
        # the next catch-up
        q_BKV = jnp.zeros((), jnp.float32) if flags.greedy else jnp.zeros((B, k, V), jnp.float32)
        carry = (jnp.int32(0), ctx.token_B, cache, ctx.history, jnp.zeros((B, k), jnp.int32), q_BKV)
        if self.pair:
            logits_BV, cache = self._first_step(aux, cache, ctx, rotation)
            d_B, history, d_BK, q_BKV = pick(0, logits_BV, ctx.history, carry[4], q_BKV)
            carry = (jnp.int32(1), d_B, cache, history, d_BK, q_BKV)
        _, _, cache, _, d_BK, q_BKV = jax.lax.while_loop(lambda carry: carry[0] < ctx.limit, one, carry)
        valid_BK = jnp.broadcast_to(jnp.arange(k)[None] < ctx.limit, (B, k))
        return Proposal(d_BK, valid_BK, None if flags.greedy else q_BKV), cache

    def commit(self, aux, cache, end_B):
        n = end_B.shape[0]
        return cache.replace(end=jnp.minimum(cache.end, end_B) if n == cache.batch else
                             cache.end.at[:n].min(end_B))


def _first_rows(cache: KVCache, x_n):
    """A view of a [B] array as its first n = len(x_n) rows."""
    n = x_n.shape[0]
    return (lambda y: y) if n == cache.batch else (lambda y: y[:n])


def _as_rows(cache: KVCache, x_n):
    """x_n [n] as the cache's [B] rows, zeros past n."""
    n = x_n.shape[0]
    return x_n if n == cache.batch else jnp.zeros((cache.batch,), x_n.dtype).at[:n].set(x_n)


# --- the pieces of a round (module functions: the negative-control tests replace them) ---------


def is_stop(token, stop_ids):
    """Whether each token is one of stop_ids [n] (padded with -1)."""
    return jnp.any(token[..., None] == stop_ids, axis=-1)


def probs(logits_BV, sampling: SamplingParams, flags: SamplingFlags):
    """The law `sample` draws from: softmax of the filtered, tempered logits; a row at
    temperature 0 one-hot at its argmax."""
    t_B1 = sampling.temperature[:, None]
    scaled_BV = logits_BV.astype(jnp.float32) / jnp.where(t_B1 > 0, t_B1, 1)
    scaled_BV = filter_logits(scaled_BV, sampling.top_k[:, None], sampling.top_p[:, None],
                              sampling.min_p[:, None], flags.top_k, flags.top_p, flags.min_p)
    p_BV = jax.nn.softmax(scaled_BV, axis=-1)
    if flags.argmax_rows:
        hot_BV = jax.nn.one_hot(argmax(logits_BV), logits_BV.shape[-1], dtype=jnp.float32)
        p_BV = jnp.where(t_B1 > 0, p_BV, hot_BV)
    return p_BV


def race(keys_B, w_BV):
    """A draw from the unnormalized weights w_BV (>= 0, some > 0) a row: argmax w / Exp(1)."""
    e_BV = jax.vmap(lambda key: jax.random.exponential(key, w_BV.shape[-1:]))(keys_B)
    # A draw of exactly 0 would make 0 / 0 a NaN, which argmax picks: zero weights never win
    return jnp.argmax(jnp.where(w_BV > 0, w_BV / e_BV, -1.0), axis=-1).astype(jnp.int32)


def round_keys(seed_B2, count_B):
    """Each row's key for a verify round: its seed folded by its token count, which grows every
    round, so no uniform is reused (a plain step draws with plain decoding's key, the same fold)."""
    return row_keys(seed_B2, count_B)


def accept(p_BJV, q_BKV, d_BK, valid_BK, keys_B):
    """(accepted n_B, the target's token x_B) under sampling: d_j stays with probability
    min(1, p/q) while all before it stayed; x from norm(max(0, p_n - q_n)), or from p_k after k."""
    B, K = d_BK.shape
    pd_BK = jnp.take_along_axis(p_BJV[:, :K], d_BK[..., None], axis=-1)[..., 0]
    qd_BK = jnp.take_along_axis(q_BKV, d_BK[..., None], axis=-1)[..., 0]
    u_BK = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 1), (K,)))(keys_B)
    a_BK = (u_BK * qd_BK <= pd_BK) & (pd_BK > 0) & valid_BK
    n_B = jnp.sum(jnp.cumprod(a_BK, axis=1), axis=1).astype(jnp.int32)
    rows = jnp.arange(B)
    p_BV = p_BJV[rows, n_B]
    q_BV = jnp.where((n_B < K)[:, None], q_BKV[rows, jnp.minimum(n_B, K - 1)], 0)
    r_BV = jnp.maximum(p_BV - q_BV, 0)
    r_BV = jnp.where(jnp.sum(r_BV, axis=-1, keepdims=True) > 0, r_BV, p_BV)  # only by rounding
    return n_B, race(jax.vmap(lambda key: jax.random.fold_in(key, 2))(keys_B), r_BV)


def rejected(written: int, kept_B):
    """Cache slots to roll back: of `written`, all but the kept ones."""
    return written - kept_B


# --- the loop -------------------------------------------------------------------------------------

class Spec(NamedTuple):
    """The static half of a speculative request."""

    proposer: Proposer
    k: int
    adaptive: bool  # pause while verify rounds do not pay (num_speculative None)
    synthetic: float | None = None  # benchmarks: accept each draft with this probability
    tuning: SpecTuning = SpecTuning()


class Policy(NamedTuple):
    """Adaptive k's state (traced scalars): the moving means of tokens a live row gains a verify
    round and of a draft's acceptance (accepted over accepted and first rejections), the step from
    which verify rounds may run again (an absolute index: plain steps do not count down), the next
    pause's length, and whether the next verify round is a probe (its figures replace the means)."""

    mean: jax.Array
    alpha: jax.Array
    resume: jax.Array
    pause: jax.Array
    probe: jax.Array


class Carry(NamedTuple):
    r: jax.Array  # target steps after the prefill (plain and verify)
    cache: KVCache
    seq_BS: jax.Array  # int32 [B, Tb + W]: the padded prompt, then each row's output
    token_B: jax.Array  # each row's pending token (its last output, not yet in the cache)
    count_B: jax.Array  # output tokens a row, the pending one included
    done_B: jax.Array
    history: tuple
    pstate: object
    go: jax.Array  # bool: the next step is a verify round
    policy: Policy
    stats: dict


def target_choices(logits_BJV, history, d_BK, sampling, flags):
    """Each verify position's logits after the penalties of its own prefix (d_1..d_j added)."""
    out = []
    for j in range(logits_BJV.shape[1]):
        out.append(penalize(logits_BJV[:, j], history, sampling, flags))
        if j < d_BK.shape[1] and (flags.repetition_penalty or flags.penalties):
            history = record(history, d_BK[:, j], jnp.ones(d_BK.shape[:1], bool))
    return jnp.stack(out, axis=1)


def judge(logits_BJV, d_BK, valid_BK, q_BKV, sampling: SamplingParams, flags: SamplingFlags, keys_B):
    """A verify round's verdict on the target's penalized logits [B, k+1, V] (`target_choices`):
    (drafts kept n_B, the target's token x_B). Greedy: the longest run of drafts equal to the
    argmax, then the argmax after it; sampling: `accept`, q_BKV None for one-hot drafts."""
    B, K = d_BK.shape
    if flags.greedy:
        x_BJ = argmax(logits_BJV.reshape(B * (K + 1), -1)).reshape(B, K + 1)
        hit_BK = (d_BK == x_BJ[:, :K]) & valid_BK
        n_B = jnp.sum(jnp.cumprod(hit_BK, axis=1), axis=1).astype(jnp.int32)
        return n_B, x_BJ[jnp.arange(B), n_B]
    p_BJV = jax.vmap(lambda l_BV: probs(l_BV, sampling, flags), in_axes=1, out_axes=1)(logits_BJV)
    if q_BKV is None:
        q_BKV = jax.nn.one_hot(d_BK, logits_BJV.shape[-1], dtype=jnp.float32)
    q_BKV = q_BKV * valid_BK[..., None]  # no draft there: the residual is p itself
    return accept(p_BJV, q_BKV, d_BK, valid_BK, keys_B)


def spec_core(params: Params, aux, tokens_BT, start_B, max_new, stop_ids, sampling: SamplingParams,
              carry=None, until=None, *, cache_length: int, steps: int, flags: SamplingFlags, kv_int8: bool,
              spec: Spec, keep: bool = False):
    """generate's loop with speculation: (tokens [B, steps], lengths [B], stats arrays). `stream`
    runs it a step at a time: `keep` (static) returns the loop's `Carry` as well, `carry` resumes
    from one (no prefill), and the loop stops after step `until`."""
    cfg = params.config
    B, Tb = tokens_BT.shape
    K = spec.k
    tuning = spec.tuning
    W = steps + K + 1  # output slots: a round may write k+1 past the last needed
    pad = jnp.int32(cfg.pad_id)
    proposer = spec.proposer
    rotation = rotation_table(cfg, cache_length) if params.tp is None else None
    rows = jnp.arange(B)
    j_J = jnp.arange(K + 1, dtype=jnp.int32)
    s_S = jnp.arange(Tb + W, dtype=jnp.int32)
    more = (lambda r: True) if until is None else (lambda r: r < until)

    def context(c: Carry, keys_B=None, limit=K) -> Context:
        keys_B = jnp.zeros((B,), jnp.uint32) if keys_B is None else keys_B  # unread where None
        return Context(c.seq_BS, Tb, c.token_B, c.count_B, c.r, c.history, sampling, flags, keys_B, limit)

    # Adaptive k for drafts that cost: the k in 1..K of the most tokens a unit of time, a round
    # costing verify_cost + k draft steps and returning (1 - a^(k+1)) / (1 - a) at acceptance a
    cost = proposer.step_cost if spec.adaptive else 0.0
    k_K = jnp.arange(1, K + 1, dtype=jnp.int32)

    def pick_k(alpha):
        if not cost:
            return K
        a = jnp.clip(alpha, 0.0, 0.99)
        gain_K = (1 - a ** (k_K + 1)) / (1 - a)
        return jnp.argmax(gain_K / (tuning.verify_cost + cost * k_K)).astype(jnp.int32) + 1

    def next_go(c: Carry, policy: Policy):
        ready_B = proposer.ready(aux, c.pstate, context(c)) & ~c.done_B
        return jnp.any(ready_B) & (c.r >= policy.resume) if spec.adaptive else jnp.any(ready_B)

    # A plain step: generate's body (step, pick, output write, stop test) and the test for the
    # next step; a done row's slot is taken back, so its cache end never moves.
    def plain(c: Carry) -> Carry:
        logits_BV, cache = step(params, c.token_B[:, None], c.cache, rotation=rotation)
        new_B = choose(logits_BV, c.history, sampling, c.count_B, flags)
        live_B = ~c.done_B
        # A select over the row, not a scatter: one elementwise kernel and no index arithmetic
        seq_BS = jnp.where(s_S[None] == (Tb + c.count_B)[:, None], new_B[:, None], c.seq_BS)
        history = record(c.history, new_B, live_B)
        count_B = c.count_B + live_B.astype(jnp.int32)
        cache = cache.replace(end=cache.end - c.done_B.astype(jnp.int32))
        done_B = c.done_B | is_stop(new_B, stop_ids) | (count_B >= max_new)
        c = c._replace(r=c.r + 1, cache=cache, seq_BS=seq_BS, token_B=new_B, count_B=count_B, done_B=done_B,
                       history=history)
        return c._replace(go=next_go(c, c.policy))

    def verify(c: Carry) -> Carry:
        count_B = c.count_B
        keys_B = None if flags.greedy and spec.synthetic is None else round_keys(sampling.seed, count_B)
        limit = pick_k(c.policy.alpha)
        ctx = context(c, keys_B, limit)
        (d_BK, valid_BK, q_BKV), pstate = proposer.propose(aux, c.pstate, ctx, K)
        logits_BJV, cache = step(params, jnp.concatenate([c.token_B[:, None], d_BK], axis=1), c.cache,
                                 rotation=rotation, all_logits=True)  # verify_attention's table too
        logits_BJV = target_choices(logits_BJV, c.history, d_BK, sampling, flags)
        if spec.synthetic is None:
            n_B, x_B = judge(logits_BJV, d_BK, valid_BK, q_BKV, sampling, flags, ctx.keys_B)
        else:
            hit_BK = _synthetic(ctx.keys_B, K, spec.synthetic) & valid_BK
            n_B = jnp.sum(jnp.cumprod(hit_BK, axis=1), axis=1).astype(jnp.int32)
            if flags.greedy:
                x_B = argmax(logits_BJV[rows, n_B])
            else:
                p_BV = probs(logits_BJV[rows, n_B], sampling, flags)
                x_B = race(jax.vmap(lambda key: jax.random.fold_in(key, 2))(ctx.keys_B), p_BV)
        emit_BJ = jnp.concatenate([d_BK, x_B[:, None]], axis=1)
        emit_BJ = jnp.where(j_J[None] < n_B[:, None], emit_BJ, x_B[:, None])  # [n] = x (later: unread)
        live_B = ~c.done_B
        kept_B = jnp.where(live_B, n_B + 1, 0)
        cache = rollback(cache, rejected(K + 1, kept_B))
        pstate = proposer.commit(aux, pstate, cache.end)
        keep_BJ = j_J[None] < kept_B[:, None]
        cols_BJ = jnp.where(keep_BJ, Tb + count_B[:, None] + j_J[None], Tb + W)  # Tb + W: dropped
        seq_BS = c.seq_BS.at[rows[:, None], cols_BJ].set(emit_BJ, mode="drop")
        history = c.history
        if flags.repetition_penalty or flags.penalties:
            for j in range(K + 1):
                history = record(history, emit_BJ[:, j], keep_BJ[:, j])
        stop_B = jnp.any(is_stop(emit_BJ, stop_ids) & keep_BJ, axis=1)
        count_B = count_B + kept_B
        done_B = c.done_B | stop_B | (count_B >= max_new)
        live = live_B.astype(jnp.int32)
        drafted = jnp.sum(jnp.sum(valid_BK, axis=1) * live)
        s = c.stats
        stats = dict(s, verify=s["verify"] + 1, drafted=s["drafted"] + drafted,
                     accepted=s["accepted"] + jnp.sum(n_B * live), hist=s["hist"].at[n_B].add(live))
        policy = c.policy
        if spec.adaptive:
            def moving(old, new):
                return jnp.where(policy.probe, new, tuning.decay * old + (1 - tuning.decay) * new)
            gain = jnp.sum(kept_B) / jnp.maximum(jnp.sum(live), 1)  # tokens a live row gained
            # a row that kept fewer than it was offered saw one rejection
            seen = jnp.sum(n_B * live) + jnp.sum((n_B < jnp.sum(valid_BK, axis=1)) * live)
            alpha = jnp.where(seen > 0, moving(policy.alpha, jnp.sum(n_B * live) / jnp.maximum(seen, 1)),
                              policy.alpha)
            mean = moving(policy.mean, gain)
            pays = mean >= tuning.verify_cost + cost * limit
            policy = Policy(mean=mean, alpha=alpha, resume=jnp.where(pays, 0, c.r + 1 + policy.pause),
                            pause=jnp.where(pays, tuning.min_pause, jnp.minimum(2 * policy.pause, tuning.max_pause)),
                            probe=~pays)
        c = Carry(c.r + 1, cache, seq_BS, x_B, count_B, done_B, history, pstate, c.go, policy, stats)
        return c._replace(go=next_go(c, policy))

    def live(c: Carry):
        return ~jnp.all(c.done_B) & more(c.r)

    def outer(c: Carry) -> Carry:
        c = jax.lax.while_loop(lambda c: c.go & live(c), verify, c)
        return jax.lax.while_loop(lambda c: ~c.go & live(c), plain, c)

    if carry is None:  # the prefill and its token
        cache = init_cache(cfg, B, cache_length, params.dtype, start_B, kv_dtype="int8" if kv_int8 else None)
        history = penalty_history(tokens_BT, start_B, cfg.vocab_size, flags)
        logits_BV, cache = step(params, tokens_BT, cache, fresh=True)
        token_B = choose(logits_BV, history, sampling, 0, flags)
        seq_BS = jnp.concatenate([tokens_BT, jnp.full((B, W), pad, jnp.int32).at[:, 0].set(token_B)], axis=1)
        done_B = is_stop(token_B, stop_ids) | (max_new <= 1)
        history = record(history, token_B, jnp.ones((B,), bool))
        pstate = proposer.init(aux, tokens_BT, start_B, cache_length, kv_int8)
        stats = dict(verify=jnp.int32(0), drafted=jnp.int32(0), accepted=jnp.int32(0),
                     hist=jnp.zeros((K + 1,), jnp.int32))
        policy = Policy(mean=jnp.float32(0), alpha=jnp.float32(1), resume=jnp.int32(0), pause=jnp.int32(tuning.min_pause),
                        probe=jnp.bool_(True))
        carry = Carry(jnp.int32(0), cache, seq_BS, token_B, jnp.ones((B,), jnp.int32), done_B, history, pstate,
                      jnp.bool_(False), policy, stats)
        carry = carry._replace(go=next_go(carry, policy))
        if until is not None:  # stream: the prefill's token first
            return (None, None, None, carry) if keep else None
    carry = jax.lax.while_loop(live, outer, carry)
    out_BN = carry.seq_BS[:, Tb:Tb + steps]
    n_N = jnp.arange(steps, dtype=jnp.int32)
    made_B = jnp.minimum(carry.count_B, max_new)
    stop_BN = is_stop(out_BN, stop_ids) & (n_N[None] < made_B[:, None])
    lengths_B = jnp.where(jnp.any(stop_BN, axis=1), jnp.argmax(stop_BN, axis=1) + 1, made_B)
    result = jnp.where(n_N < lengths_B[:, None], out_BN, pad), lengths_B.astype(jnp.int32), totals(carry)
    return result + (carry,) if keep else result


def totals(carry: Carry) -> dict:
    """The loop's counters (device arrays) for `make_stats`: a live row's target steps are its
    tokens after the first, less the drafts it had accepted."""
    return dict(carry.stats, rounds=carry.r, row_rounds=jnp.sum(carry.count_B - 1) - carry.stats["accepted"])


def _synthetic(keys_B, K: int, rate: float):
    """Benchmarks on random weights: each draft 'accepted' with probability `rate`."""
    u_BK = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 3), (K,)))(keys_B)
    return u_BK < rate


def make_stats(k: int, stats, lengths) -> SpecStats:
    s = jax.device_get(stats)
    return SpecStats(k=k, rounds=int(s["rounds"]), verify_rounds=int(s["verify"]),
                     row_rounds=int(s["row_rounds"]), drafted=int(s["drafted"]), accepted=int(s["accepted"]),
                     histogram=tuple(int(h) for h in np.asarray(s["hist"])),
                     tokens=int(np.sum(np.asarray(lengths))) - len(np.asarray(lengths)))


def plain_stats(k: int, lengths) -> SpecStats:
    """The stats of a call the batch policy decoded plainly: one token a row a step."""
    lengths = np.asarray(lengths)
    made = int(np.sum(lengths)) - len(lengths)
    return SpecStats(k=k, rounds=int(lengths.max()) - 1, verify_rounds=0, row_rounds=made, drafted=0,
                     accepted=0, histogram=(0,) * (k + 1), tokens=made, off_at_batch=True)


def speculates(spec: Spec, rows: int) -> bool:
    """Whether a call of `rows` rows speculates: always with a fixed k, the default only up to
    the tuning's batch limit for its proposer."""
    return not spec.adaptive or rows <= spec.tuning.batch_limit(spec.proposer)


def drafts_a_round(kind: str, num_speculative) -> int:
    """k: `num_speculative` checked, or the kind's ("ngram", "draft") default where it is None."""
    return DEFAULT_K[kind] if num_speculative is None else whole("num_speculative", num_speculative, 1, 32)


def resolve(params: Params, speculative, num_speculative, synthetic=None, tuning: SpecTuning | None = None):
    """(Spec, aux) of generate's `speculative` / `num_speculative` arguments, checked."""
    tuning = tuning or current()
    if isinstance(speculative, str):
        if speculative != "ngram":
            raise ValueError(f"speculative must be 'ngram', a draft model's Params or a Proposer, "
                             f"got {speculative!r}")
        proposer, aux, kind = NGram(), None, "ngram"
    elif isinstance(speculative, Params):
        dc, tc = speculative.config, params.config
        if dc.vocab_size != tc.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({dc.vocab_size} ids) is not the target's "
                             f"({tc.vocab_size}): a draft must share the tokenizer")
        if (speculative.tp is None) != (params.tp is None):
            raise ValueError("the draft model and the target must both be sharded or both not")
        # a draft step's cost in target steps: at small batch both read their weights once
        proposer = Draft(step_cost=param_bytes(speculative) / param_bytes(params),
                         pair=tuning.draft_pair)
        aux, kind = speculative, "draft"
    elif isinstance(speculative, Proposer):
        proposer, aux, kind = speculative, getattr(speculative, "aux", None), "draft"
    else:
        raise TypeError(f"speculative must be 'ngram', a draft model's Params or a Proposer, got "
                        f"{type(speculative).__name__}")
    adaptive = num_speculative is None
    k = drafts_a_round(kind, num_speculative)
    if synthetic is not None and not 0 <= float(synthetic) <= 1:
        raise ValueError(f"synthetic acceptance must be in [0, 1], got {synthetic}")
    return Spec(proposer, k, adaptive, None if synthetic is None else float(synthetic),
                tuning), aux
