"""Speculative decoding: propose k tokens a row, check them with one target step over k+1
positions, keep the longest run the target agrees with, all inside one `lax.while_loop`.

A round, per row: the pending token x (emitted, not yet in the cache) and drafts d_1..d_k go
through `step(..., all_logits=True)` at the row's end; the target's distributions p_0..p_k (after
the same penalties and filters as plain decoding, each on its own prefix) decide how many drafts
n stay (greedy: those equal to the argmax; sampling: Leviathan et al.'s rule, accept d_j with
probability min(1, p/q), on the first rejection draw from norm(max(0, p - q)), after k
acceptances a bonus token from p_k); the row then emits d_1..d_n and one target token, and
`rollback` drops the k - n rejected cache slots, which the next round overwrites. Greedy output
equals plain greedy token for token; sampled output has the target's law, not plain sampling's
tokens for a seed.

Proposers: `NGram` (prompt lookup: the tokens after the latest earlier occurrence of the row's
last n tokens in its prompt and output; q is one-hot) and `Draft` (a second model sharing the
vocabulary, its own cache, run k steps; q is its filtered distribution). A round with no draft
in any row, or while the batch's recent acceptance is too low (adaptive k), takes the plain
one-token step through a `lax.cond`, so speculation never costs a verify step for nothing.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.engine.sampling import SamplingFlags, SamplingParams, argmax, choose, filter_logits, penalize, \
    penalty_history, record, row_keys
from jaxllm.model.cache import init_cache, rollback
from jaxllm.model.params import Params
from jaxllm.model.transformer import rotation_table, step

# Adaptive k: a batch speculates while the moving mean of its accepted fraction stays at or above
# ADAPT_MIN (a verify round must return about twice a plain step's tokens to pay on a GPU), and
# probes once every ADAPT_PROBE rounds while it is below.
ADAPT_MIN = 0.25
ADAPT_DECAY = 0.7
ADAPT_PROBE = 8
DEFAULT_K = {"ngram": 7, "draft": 3}


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
    """What a proposer may read in a round (traced): the padded prompts [B, Tb], the output so
    far [B, W] (count_B tokens a row, the last one the pending token), the round index, the
    penalties' history, the sampling settings and each row's round key."""

    tokens_BT: jax.Array
    out_BW: jax.Array
    count_B: jax.Array
    round: jax.Array
    history: tuple
    sampling: SamplingParams
    flags: SamplingFlags
    keys_B: jax.Array


class Proposal(NamedTuple):
    d_BK: jax.Array  # int32 drafts
    valid_BK: jax.Array  # bool: a draft exists there (a run of trues from the left)
    q_BKV: jax.Array | None  # the law each draft was drawn from; None: one-hot (deterministic)


class Proposer:
    """How drafts are made. `aux` is the proposer's traced data (a draft's params), `state` what
    it carries between rounds. `cheap`: proposals are made before the round's branch, and a batch
    without any draft takes the plain step."""

    cheap = True

    def init(self, aux, tokens_BT, start_B, cache_length: int, kv_int8: bool):
        return ()

    def propose(self, aux, state, ctx: Context, k: int) -> tuple[Proposal, object]:
        raise NotImplementedError

    def commit(self, aux, state, written: int, kept_B):
        """After the round: `written` tokens went in (k+1 in a verify round, 1 in a plain one),
        of which kept_B stay."""
        return state


@dataclasses.dataclass(frozen=True)
class NGram(Proposer):
    """Prompt lookup: match the row's last n tokens (longest n in [min_n, max_n] first) against
    its earlier tokens, latest match first, and propose the tokens that followed."""

    max_n: int = 3
    min_n: int = 1

    def init(self, aux, tokens_BT, start_B, cache_length, kv_int8):
        return start_B

    def commit(self, aux, state, written, kept_B):
        return state

    def propose(self, aux, start_B, ctx, k):
        seq_BS = jnp.concatenate([ctx.tokens_BT, ctx.out_BW], axis=1)
        B, S = seq_BS.shape
        last_B = ctx.tokens_BT.shape[1] + ctx.count_B - 1  # the pending token's index
        i_S = jnp.arange(S, dtype=jnp.int32)
        rows = jnp.arange(B)
        match_BS = jnp.ones((B, S), bool)
        best_B = jnp.full((B,), -1, jnp.int32)
        for n in range(1, self.max_n + 1):
            m = n - 1
            tail_B = seq_BS[rows, jnp.maximum(last_B - m, 0)]
            shifted_BS = jnp.pad(seq_BS, ((0, 0), (m, 0)), constant_values=-1)[:, :S]  # [i] = seq[i - m]
            match_BS = match_BS & (shifted_BS == tail_B[:, None])
            ok_BS = match_BS & (i_S[None] - m >= start_B[:, None]) & (i_S[None] < last_B[:, None]) & \
                (last_B - m >= start_B)[:, None]
            at_B = jnp.max(jnp.where(ok_BS, i_S[None], -1), axis=1)  # the latest match
            if n >= self.min_n:
                best_B = jnp.where(at_B >= 0, at_B, best_B)  # a longer n overrides
        j_K = jnp.arange(1, k + 1, dtype=jnp.int32)
        at_BK = best_B[:, None] + j_K[None]
        valid_BK = (best_B[:, None] >= 0) & (at_BK <= last_B[:, None])
        d_BK = jnp.take_along_axis(seq_BS, jnp.clip(at_BK, 0, S - 1), axis=1)
        return Proposal(jnp.where(valid_BK, d_BK, 0), valid_BK, None), start_B


@dataclasses.dataclass(frozen=True)
class Draft(Proposer):
    """A draft model sharing the target's vocabulary: its own cache (the same slots), k steps a
    round drawing from its own filtered distribution, one more writing d_k so that a fully
    accepted round leaves it in step with the target."""

    cheap = False


    def init(self, aux, tokens_BT, start_B, cache_length, kv_int8):
        cache = init_cache(aux.config, tokens_BT.shape[0], cache_length, aux.dtype, start_B,
                           kv_dtype="int8" if kv_int8 else None)
        _, cache = step(aux, tokens_BT, cache, fresh=True)
        return cache

    def propose(self, aux, cache, ctx, k):
        rotation = rotation_table(aux.config, cache.length) if aux.tp is None else None
        flags = ctx.flags

        def one(carry, j):
            token_B, cache, history = carry
            logits_BV, cache = step(aux, token_B[:, None], cache, rotation=rotation)
            logits_BV = penalize(logits_BV, history, ctx.sampling, flags)
            if flags.greedy:
                d_B, q_BV = argmax(logits_BV), jnp.zeros((), jnp.float32)
            else:
                q_BV = probs(logits_BV, ctx.sampling, flags)
                d_B = race(jax.vmap(lambda key: jax.random.fold_in(key, 100 + j))(ctx.keys_B), q_BV)
            return (d_B, cache, record(history, d_B, jnp.ones_like(d_B, bool))), (d_B, q_BV)

        pending_B = ctx.out_BW[jnp.arange(ctx.count_B.shape[0]), ctx.count_B - 1]
        (last_B, cache, _), (d_KB, q_KBV) = jax.lax.scan(one, (pending_B, cache, ctx.history),
                                                       jnp.arange(k, dtype=jnp.int32))
        _, cache = step(aux, last_B[:, None], cache, rotation=rotation)
        d_BK = d_KB.T
        q_BKV = None if flags.greedy else q_KBV.transpose(1, 0, 2)
        return Proposal(d_BK, jnp.ones(d_BK.shape, bool), q_BKV), cache

    def commit(self, aux, cache, written, kept_B):
        return rollback(cache, rejected(written, kept_B))


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
    """Each row's key for a round: its seed folded by its token count, which grows every round,
    so no uniform is reused; a plain round draws with exactly plain decoding's key."""
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
    adaptive: bool
    synthetic: float | None = None  # benchmarks: accept each draft with this probability


def _target_choices(logits_BJV, history, d_BK, sampling, flags):
    """Each verify position's logits after the penalties of its own prefix (d_1..d_j added)."""
    out = []
    for j in range(logits_BJV.shape[1]):
        out.append(penalize(logits_BJV[:, j], history, sampling, flags))
        if j < d_BK.shape[1] and (flags.repetition_penalty or flags.penalties):
            history = record(history, d_BK[:, j], jnp.ones(d_BK.shape[:1], bool))
    return jnp.stack(out, axis=1)


def spec_core(params: Params, aux, tokens_BT, start_B, max_new, stop_ids, sampling: SamplingParams,
              carry=None, until=None, *, cache_length: int, steps: int, flags: SamplingFlags, kv_int8: bool,
              spec: Spec, keep: bool = False):
    """generate's loop with speculation: (tokens [B, steps], lengths [B], stats arrays). `stream`
    runs it a round at a time: `keep` (static) returns the loop's carry as well, `carry` resumes
    from one (no prefill), and the loop stops after round `until`."""
    cfg = params.config
    B = tokens_BT.shape[0]
    K = spec.k
    W = steps + K + 1  # output slots: a round may write k+1 past the last needed
    pad = jnp.int32(cfg.pad_id)
    proposer = spec.proposer
    rotation = rotation_table(cfg, cache_length) if params.tp is None else None
    rows = jnp.arange(B)
    j_J = jnp.arange(K + 1, dtype=jnp.int32)
    stats0 = dict(rounds=jnp.int32(0), verify=jnp.int32(0), row_rounds=jnp.int32(0),
                  drafted=jnp.int32(0), accepted=jnp.int32(0), hist=jnp.zeros((K + 1,), jnp.int32),
                  ema=jnp.float32(1))

    def verify(cache, pstate, ctx, proposal):
        if proposal is None:
            proposal, pstate = proposer.propose(aux, pstate, ctx, K)
        d_BK, valid_BK, q_BKV = proposal
        pending_B = ctx.out_BW[rows, ctx.count_B - 1]
        logits_BJV, cache = step(params, jnp.concatenate([pending_B[:, None], d_BK], axis=1), cache,
                                 all_logits=True)
        logits_BJV = _target_choices(logits_BJV, ctx.history, d_BK, sampling, flags)
        if flags.greedy:
            x_BJ = argmax(logits_BJV.reshape(B * (K + 1), -1)).reshape(B, K + 1)
            if spec.synthetic is None:
                hit_BK = (d_BK == x_BJ[:, :K]) & valid_BK
            else:
                hit_BK = _synthetic(ctx.keys_B, K, spec.synthetic) & valid_BK
            n_B = jnp.sum(jnp.cumprod(hit_BK, axis=1), axis=1).astype(jnp.int32)
            x_B = x_BJ[rows, n_B]
        else:
            p_BJV = jax.vmap(lambda l_BV: probs(l_BV, sampling, flags), in_axes=1, out_axes=1)(logits_BJV)
            if q_BKV is None:
                q_BKV = jax.nn.one_hot(d_BK, cfg.vocab_size, dtype=jnp.float32)
            q_BKV = q_BKV * valid_BK[..., None]  # no draft there: the residual is p itself
            if spec.synthetic is None:
                n_B, x_B = accept(p_BJV, q_BKV, d_BK, valid_BK, ctx.keys_B)
            else:
                hit_BK = _synthetic(ctx.keys_B, K, spec.synthetic) & valid_BK
                n_B = jnp.sum(jnp.cumprod(hit_BK, axis=1), axis=1).astype(jnp.int32)
                x_B = race(jax.vmap(lambda key: jax.random.fold_in(key, 2))(ctx.keys_B), p_BJV[rows, n_B])
        emit_BJ = jnp.concatenate([d_BK, x_B[:, None]], axis=1)
        emit_BJ = jnp.where(j_J[None] < n_B[:, None], emit_BJ, x_B[:, None])  # [n] = x (later: unread)
        return cache, pstate, n_B, emit_BJ, jnp.sum(valid_BK, axis=1).astype(jnp.int32), K + 1

    def plain(cache, pstate, ctx):
        pending_B = ctx.out_BW[rows, ctx.count_B - 1]
        logits_BV, cache = step(params, pending_B[:, None], cache, rotation=rotation)
        x_B = choose(logits_BV, ctx.history, sampling, ctx.count_B, flags)
        if isinstance(proposer, Draft):  # the draft's cache takes the pending token too
            drot = rotation_table(aux.config, cache_length) if aux.tp is None else None
            _, pstate = step(aux, pending_B[:, None], pstate, rotation=drot)
        emit_BJ = jnp.broadcast_to(x_B[:, None], (B, K + 1))
        return cache, pstate, jnp.zeros((B,), jnp.int32), emit_BJ, jnp.zeros((B,), jnp.int32), 1

    def cond(carry):
        return ~jnp.all(carry[3]) & (True if until is None else carry[0] < until)

    def body(carry):
        r, cache, out_BW, done_B, count_B, history, pstate, stats = carry
        keys_B = None if flags.greedy and spec.synthetic is None else round_keys(sampling.seed, count_B)
        if keys_B is None:
            keys_B = jnp.zeros((B,), jnp.uint32)  # unread
        ctx = Context(tokens_BT, out_BW, count_B, r, history, sampling, flags, keys_B)
        go = (stats["ema"] >= ADAPT_MIN) | (r % ADAPT_PROBE == 0) if spec.adaptive else jnp.bool_(True)
        if proposer.cheap:
            proposal, pstate = proposer.propose(aux, pstate, ctx, K)
            go = go & jnp.any(proposal.valid_BK[:, 0] & ~done_B)
        else:
            proposal = None

        def spec_branch(operands):
            cache, pstate = operands
            cache, pstate, n_B, emit_BJ, drafted_B, written = verify(cache, pstate, ctx, proposal)
            return _finish(cache, pstate, n_B, emit_BJ, drafted_B, written)

        def plain_branch(operands):
            cache, pstate = operands
            return _finish(*plain(cache, pstate, ctx))

        def _finish(cache, pstate, n_B, emit_BJ, drafted_B, written):
            kept_B = jnp.where(done_B, 0, n_B + 1)
            cache = rollback(cache, rejected(written, kept_B))
            pstate = proposer.commit(aux, pstate, written, kept_B)
            return cache, pstate, n_B, emit_BJ, drafted_B

        cache, pstate, n_B, emit_BJ, drafted_B = jax.lax.cond(go, spec_branch, plain_branch, (cache, pstate))
        live_B = ~done_B
        kept_B = jnp.where(live_B, n_B + 1, 0)
        keep_BJ = j_J[None] < kept_B[:, None]
        cols_BJ = jnp.where(keep_BJ, count_B[:, None] + j_J[None], W)  # W: dropped
        out_BW = out_BW.at[rows[:, None], cols_BJ].set(emit_BJ, mode="drop")
        for j in range(K + 1):
            if flags.repetition_penalty or flags.penalties:
                history = record(history, emit_BJ[:, j], keep_BJ[:, j])
        stop_B = jnp.any(is_stop(emit_BJ, stop_ids) & keep_BJ, axis=1)
        count_B = count_B + kept_B
        done_B = done_B | stop_B | (count_B >= max_new)
        live = live_B.astype(jnp.int32)
        hist = stats["hist"].at[n_B].add(live * go.astype(jnp.int32))
        drafted = jnp.sum(drafted_B * live)
        frac = jnp.sum(n_B * live) / jnp.maximum(drafted, 1)
        ema = jnp.where(go & (drafted > 0), ADAPT_DECAY * stats["ema"] + (1 - ADAPT_DECAY) * frac, stats["ema"])
        stats = dict(rounds=stats["rounds"] + 1, verify=stats["verify"] + go.astype(jnp.int32),
                     row_rounds=stats["row_rounds"] + jnp.sum(live), drafted=stats["drafted"] + drafted,
                     accepted=stats["accepted"] + jnp.sum(n_B * live * go.astype(jnp.int32)), hist=hist, ema=ema)
        return r + 1, cache, out_BW, done_B, count_B, history, pstate, stats

    if carry is None:  # the prefill and its token
        cache = init_cache(cfg, B, cache_length, params.dtype, start_B, kv_dtype="int8" if kv_int8 else None)
        history = penalty_history(tokens_BT, start_B, cfg.vocab_size, flags)
        logits_BV, cache = step(params, tokens_BT, cache, fresh=True)
        token_B = choose(logits_BV, history, sampling, 0, flags)
        out_BW = jnp.full((B, W), pad, jnp.int32).at[:, 0].set(token_B)
        done_B = is_stop(token_B, stop_ids) | (max_new <= 1)
        history = record(history, token_B, jnp.ones((B,), bool))
        pstate = proposer.init(aux, tokens_BT, start_B, cache_length, kv_int8)
        carry = (jnp.int32(0), cache, out_BW, done_B, jnp.ones((B,), jnp.int32), history, pstate, stats0)
        if until is not None:  # stream: the prefill's token first
            return (None, None, None, carry) if keep else None
    carry = jax.lax.while_loop(cond, body, carry)
    _, _, out_BW, _, count_B, _, _, stats = carry
    out_BN = out_BW[:, :steps]
    n_N = jnp.arange(steps, dtype=jnp.int32)
    made_B = jnp.minimum(count_B, max_new)
    stop_BN = is_stop(out_BN, stop_ids) & (n_N[None] < made_B[:, None])
    lengths_B = jnp.where(jnp.any(stop_BN, axis=1), jnp.argmax(stop_BN, axis=1) + 1, made_B)
    result = jnp.where(n_N < lengths_B[:, None], out_BN, pad), lengths_B.astype(jnp.int32), stats
    return result + (carry,) if keep else result


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


def resolve(params: Params, speculative, num_speculative, synthetic=None):
    """(Spec, aux) of generate's `speculative` / `num_speculative` arguments, checked."""
    from jaxllm.engine.sampling import whole
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
        proposer, aux, kind = Draft(), speculative, "draft"
    elif isinstance(speculative, Proposer):
        proposer, aux, kind = speculative, getattr(speculative, "aux", None), "draft"
    else:
        raise TypeError(f"speculative must be 'ngram', a draft model's Params or a Proposer, got "
                        f"{type(speculative).__name__}")
    adaptive = num_speculative is None
    k = DEFAULT_K[kind] if adaptive else whole("num_speculative", num_speculative, 1, 32)
    if synthetic is not None and not 0 <= float(synthetic) <= 1:
        raise ValueError(f"synthetic acceptance must be in [0, 1], got {synthetic}")
    return Spec(proposer, k, adaptive, None if synthetic is None else float(synthetic)), aux
