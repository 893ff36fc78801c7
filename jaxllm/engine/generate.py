"""Text generation: validate on the host, then prefill and the whole token loop on the device.

`generate` pads the prompts on the left to a bucketed length, sizes the cache to a bucketed
prompt + new-token count, and runs prefill and a `lax.while_loop` of decode steps in one jitted
call: no host round trip per token, and prompts within one bucket reuse one compilation.
`stream` yields token ids one at a time for interactive use (one host round trip per token).
"""

from __future__ import annotations

import operator
import os
from functools import partial, reduce
from typing import Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.engine import memory, speculative as spec_mod
from jaxllm.engine.compile import check_recompile, compile_count, kernels_visible, shape_text
from jaxllm.engine.memory import check_fit
from jaxllm.engine.sampling import (INT32_MAX, SamplingConfig, SamplingFlags, SamplingParams,
                                    apply_presence_frequency_penalty, apply_repetition_penalty, row_keys,
                                    sample, whole)
from jaxllm.engine.steps import check_kv_int8, check_tokens
from jaxllm.env import env_flag
from jaxllm.layers import dense as L
from jaxllm.model.cache import init_cache, is_int8
from jaxllm.model.params import Params, is_quantized, require_params
from jaxllm.model.transformer import AUTOTUNE_OPTIONS, jitted_step, rotation_table, step

MIN_BUCKET = 16
STOP_SLOTS = 8  # stop ids are padded to a multiple of this, so their count does not recompile

# XLA records each decode step's kernels as one command buffer (a CUDA graph), but by default the
# while loop around the steps stays with the host: it reads the loop condition back and launches
# the next step's graph. With WHILE and CONDITIONAL among the recorded commands the whole loop is
# one graph (CUDA conditional nodes), and no step waits for the host. On an H200 (bench, batch 1,
# prompt 128 + 256 new, same run): SmolLM2 0.5032 against 0.5134 ms a step, Qwen3-0.6B 0.7343
# against 0.7494, Llama-3.2-1B 0.8525 against 0.8673, the 8B shape 3.9501 against 3.9544. The
# rest of the list is XLA's default. The profiler does not show the kernels of a loop recorded
# so, so while `jaxllm.trace` records (or warms up for) a trace, generate compiles its loop the
# default way. JAXLLM_LOOP_GRAPH=0, or XLA_FLAGS naming the option, leave XLA's default too.
LOOP_GRAPH_OPTIONS = {"xla_gpu_enable_command_buffer":
                      "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"}
# A batch-1 generate of a dense model on a GPU has matrix products only in its prefill (a decode
# step's are row reductions), where cuBLAS alone was as fast as XLA's pick among cuBLAS and its
# own Triton GEMMs, whose autotuning compiles dozens of Triton kernels a shape. The 8B shape on
# an H200 (bench): with no compilation cache, 6.19 s to compile against 7.11 with Triton's
# GEMMs back (`--xla_gpu_enable_triton_gemm=true`, same run; process-wide in an earlier run,
# 4.27 s against 7.12 and 5.81); a fresh machine's first call 7.3 s; a 2048-token prefill 47.1
# ms against 47.8, a decode step unchanged. `--xla_gpu_autotune_level=0` compiled as fast but
# made a 128-token prefill 96.6 ms. Batch 32 keeps XLA's pick (its decode GEMMs are Triton's:
# 4.853 ms a step against 4.926), and so do MoE models (their decode steps multiply experts as
# GEMMs; not measured) and int8 weights (a Triton GEMM converts them as it loads; cuBLAS would
# want each matrix converted to bf16 first). XLA_FLAGS naming the option leave XLA's default.
ONE_ROW_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


class GenerateOutput(NamedTuple):
    tokens: jax.Array  # int32 [B, max_new_tokens]; the pad id after a row stops
    lengths: jax.Array  # int32 [B]: new tokens per row, the stop token included
    stats: "speculative.SpecStats | None" = None  # with `speculative`: acceptance and tokens per step


def bucket(n: int) -> int:
    """Powers of two from 16 to 1024, then multiples of 1024: few shapes, at most 2x padding."""
    if n <= MIN_BUCKET:
        return MIN_BUCKET
    if n <= 1024:
        return 1 << (n - 1).bit_length()
    return -(-n // 1024) * 1024


def pad_prompts(params: Params, ids) -> tuple[np.ndarray, np.ndarray, int]:
    """Left-pad a [B, T] array or a ragged list of prompts to a bucketed width.

    Returns (tokens [B, Tb], start [B], longest prompt length). Validates every id.
    """
    cfg = params.config
    prompt = (list, tuple, np.ndarray, jax.Array)
    if isinstance(ids, (list, tuple)) and (len(ids) == 0 or isinstance(ids[0], prompt)):
        rows = []
        for b, r in enumerate(ids):
            try:
                row = np.asarray(r) if isinstance(r, prompt) else None
            except ValueError:  # numpy's "inhomogeneous shape"
                raise ValueError(f"prompt {b} must be a flat list of token ids: it holds a nested list") \
                    from None
            if row is None or row.ndim != 1:
                got = type(r).__name__ if row is None else f"shape {row.shape}"
                raise ValueError(f"prompt {b} must be a list of token ids, got {got}")
            if isinstance(r, (list, tuple)) and row.dtype.kind in "iu":  # numpy made a True among ints 1
                j = next((j for j, t in enumerate(r) if isinstance(t, (bool, np.bool_))), None)
                if j is not None:
                    raise ValueError(f"token ids must be integers, got {r[j]!r} (a bool) at position {j} "
                                     f"of prompt {b}")
            rows.append(check_tokens(cfg, row) if row.size else np.zeros((0,), np.int32))
    else:
        try:
            arr = np.asarray(ids)
        except ValueError:  # numpy's "inhomogeneous shape"
            raise ValueError("ids must be a [B, T] array or a list of token lists: it holds rows of "
                             "different shapes or a nested list") from None
        if arr.ndim != 2:
            raise ValueError(f"ids must be a [B, T] array or a list of token lists, got shape {arr.shape}")
        # An empty array's dtype says nothing (numpy's is float64): its emptiness is the problem
        rows = list(check_tokens(cfg, arr) if arr.size else np.zeros(arr.shape, np.int32))
    if not rows:
        raise ValueError("ids holds no prompt (batch of 0)")
    for b, r in enumerate(rows):
        if len(r) == 0:
            raise ValueError(f"prompt {b} is empty: generation needs at least one token")
    longest = max(len(r) for r in rows)
    width = bucket(longest)
    tokens = np.full((len(rows), width), cfg.pad_id, np.int32)
    start = np.zeros((len(rows),), np.int32)
    for b, r in enumerate(rows):
        tokens[b, width - len(r):] = r
        start[b] = width - len(r)
    return tokens, start, longest


def _stop_array(stop_ids: Sequence[int]) -> jax.Array:
    n = max(STOP_SLOTS, -(-len(stop_ids) // STOP_SLOTS) * STOP_SLOTS)
    return jnp.asarray(list(stop_ids) + [-1] * (n - len(stop_ids)), jnp.int32)


def _seen_from_prompt(tokens_BT, start_B, vocab: int):
    """[B, V] bool: which ids occur in each row's prompt (padding excluded)."""
    B, T = tokens_BT.shape
    real_BT = jnp.arange(T)[None, :] >= start_B[:, None]
    seen = jnp.zeros((B, vocab), bool)
    return seen.at[jnp.arange(B)[:, None], tokens_BT].max(real_BT)


def _history(tokens_BT, start_B, vocab: int, flags: SamplingFlags):
    """What the penalties read of each row's tokens, only where `flags` use it: (seen [B, V] bool,
    the prompt's ids and then the generated ones, for the repetition penalty; counts [B, V] int32
    of the generated ids, for presence and frequency), None for a part no row uses."""
    B = tokens_BT.shape[0]
    seen = _seen_from_prompt(tokens_BT, start_B, vocab) if flags.repetition_penalty else None
    return seen, jnp.zeros((B, vocab), jnp.int32) if flags.penalties else None


def _record(history, token_B, live_B):
    """`history` with each live row's new token counted."""
    seen, counts = history
    rows = jnp.arange(token_B.shape[0])
    if seen is not None:
        seen = seen.at[rows, token_B].max(live_B)
    if counts is not None:
        counts = counts.at[rows, token_B].add(live_B.astype(jnp.int32))
    return seen, counts


def _choose(logits_BV, history, sampling: SamplingParams, index, flags: SamplingFlags):
    """Penalties, then sampling, each row with its key folded by the token's index (same in
    generate and stream)."""
    seen_BV, counts_BV = history
    if flags.repetition_penalty:
        logits_BV = apply_repetition_penalty(logits_BV, seen_BV, sampling.repetition_penalty[:, None])
    if flags.penalties:
        logits_BV = apply_presence_frequency_penalty(logits_BV, counts_BV, sampling.presence_penalty[:, None],
                                                     sampling.frequency_penalty[:, None])
    with jax.named_scope("sampling"):
        keys = None if flags.greedy else row_keys(sampling.seed, index)
        return sample(logits_BV, keys, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p,
                      greedy=flags.greedy, use_top_k=flags.top_k, use_top_p=flags.top_p, use_min_p=flags.min_p,
                      argmax_rows=flags.argmax_rows)


def _generate_core_fn(params: Params, tokens_BT, start_B, max_new, stop_ids, sampling: SamplingParams, *,
                      cache_length: int, steps: int, flags: SamplingFlags, kv_int8: bool = False):
    cfg = params.config
    B = tokens_BT.shape[0]
    pad = jnp.int32(cfg.pad_id)
    cache = init_cache(cfg, B, cache_length, params.dtype, start_B, kv_dtype="int8" if kv_int8 else None)
    history = _history(tokens_BT, start_B, cfg.vocab_size, flags)
    logits_BV, cache = step(params, tokens_BT, cache, fresh=True)
    token_B = _choose(logits_BV, history, sampling, 0, flags)
    out_BN = jnp.full((B, steps), pad, jnp.int32).at[:, 0].set(token_B)
    done_B = _is_stop(token_B, stop_ids)
    history = _record(history, token_B, jnp.ones((B,), bool))

    def cond(carry):
        i, _, _, _, done_B, _ = carry
        return (i < max_new) & ~jnp.all(done_B)

    # A step's bookkeeping is only what the loop needs: the token, its stop test (for the loop's
    # condition) and the output write. The lengths and the padding after each row's stop token
    # follow from the tokens once, after the loop: every small op in the loop is a kernel of its
    # own in every step, 1-1.5 us each on an H200 against SmolLM2's 17 us layers. A SmolLM2 step
    # ran 10 such kernels after the lm_head, now 6 (traces). With the loop graph above, same run:
    # SmolLM2 0.5008 against 0.5231 ms a step, Qwen3-0.6B 0.7338 against 0.7449, Llama-3.2-1B
    # 0.8316 against 0.8404.
    # The decode kernel's cos and sin by position, once (sharded steps make theirs per step)
    rotation = rotation_table(cfg, cache_length) if params.tp is None else None

    def body(carry):
        i, token_B, cache, out_BN, done_B, history = carry
        logits_BV, cache = step(params, token_B[:, None], cache, rotation=rotation)
        new_B = _choose(logits_BV, history, sampling, i, flags)
        out_BN = jax.lax.dynamic_update_slice(out_BN, new_B[:, None], (jnp.int32(0), i))
        history = _record(history, new_B, ~done_B)
        return i + 1, new_B, cache, out_BN, done_B | _is_stop(new_B, stop_ids), history

    carry = (jnp.int32(1), token_B, cache, out_BN, done_B, history)
    made, _, _, out_BN, _, _ = jax.lax.while_loop(cond, body, carry)
    # A row's length runs to its first stop token (included), else to the steps made; a done
    # row's later steps (whose tokens no one reads) become padding.
    n_N = jnp.arange(steps, dtype=jnp.int32)
    stop_BN = _is_stop(out_BN, stop_ids) & (n_N < made)
    lengths_B = jnp.where(jnp.any(stop_BN, axis=1), jnp.argmax(stop_BN, axis=1) + 1, made)
    return jnp.where(n_N < lengths_B[:, None], out_BN, pad), lengths_B.astype(jnp.int32)


_STATIC = ("cache_length", "steps", "flags", "kv_int8")


def _options(graph: bool, cublas: bool) -> dict:
    return {**AUTOTUNE_OPTIONS, **(LOOP_GRAPH_OPTIONS if graph else {}), **(ONE_ROW_OPTIONS if cublas else {})}


_cores = {(graph, cublas): jax.jit(_generate_core_fn, static_argnames=_STATIC,
                                   compiler_options=_options(graph, cublas) or None)
          for graph in (True, False) for cublas in (False, True)}
_generate_core, _generate_core_host_loop = _cores[True, False], _cores[False, False]


def _choice(rows: int = 0, params: Params | None = None) -> tuple[bool, bool]:
    """Which of `_cores` generate runs for `rows` prompts of `params`: one graph, unless a trace
    needs its kernels or the environment says otherwise (see LOOP_GRAPH_OPTIONS); cuBLAS's GEMMs
    only for one row of a dense float model on a GPU (see ONE_ROW_OPTIONS)."""
    flags = os.environ.get("XLA_FLAGS", "")
    graph = not (kernels_visible() or not env_flag("JAXLLM_LOOP_GRAPH", True)
                 or "xla_gpu_enable_command_buffer" in flags)
    cublas = (rows == 1 and params is not None and params.config.num_experts == 0
              and L.gpu_generation() > 0 and "xla_gpu_enable_triton_gemm" not in flags
              and not is_quantized(params))  # the tree walk last, on GPUs only
    return graph, cublas


def _core(rows: int = 0, params: Params | None = None):
    """The compiled loop `generate` runs for `rows` prompts of `params` (see `_choice`)."""
    return _cores[_choice(rows, params)]


def compiler_options(rows: int, params: Params) -> dict:
    """The XLA options generate's loop compiles with for `rows` prompts of `params`: for a program
    that should compile as generate's does (scripts/bench.py times the prefill so)."""
    return _options(*_choice(rows, params))


# `memory.program_bytes` of generate's compiled loop (and of stream's prefill step) by what
# decides it (the program, the params' tree, shapes and dtypes, the plan's shapes, the static
# arguments). A warm call pays that key
# (61 us for SmolLM2's params on a CPU), not a trace and lowering found in the jit's caches (1.7
# ms) nor a second set of the loop's argument arrays: keyed by those, the check made a warm 8B
# int8 generate 2.8 ms slower on an H200 (645.4 against 642.6 ms unchecked), now 0.3 ms or less.
_ALLOCATED: dict = {}


def _counted(compiled, params: Params, *signature) -> int:
    """`memory.program_bytes` of `compiled()`, a program of `params` and the rest of what decides
    it (`signature`), counted once per program in _ALLOCATED."""
    leaves, tree = jax.tree.flatten(params)
    key = (tree, tuple((x.shape, x.dtype) for x in leaves), *signature)
    if key not in _ALLOCATED:
        _ALLOCATED[key] = memory.program_bytes(compiled())
    return _ALLOCATED[key]


def _is_stop(token, stop_ids):
    """Whether each token is one of stop_ids [n] (padded with -1). Up to STOP_SLOTS ids (the usual
    case): n compares, so the test fuses with the ops around it where a reduction is a kernel of
    its own. More: one compare against all of them and a reduction, since n compares compile in
    time that grows with n (2000 stop ids: 38 s on a CPU)."""
    if stop_ids.shape[0] <= STOP_SLOTS:
        return reduce(operator.or_, [token == stop_ids[j] for j in range(stop_ids.shape[0])])
    return jnp.any(token[..., None] == stop_ids, axis=-1)


def _request(params: Params, max_new_tokens, sampling: SamplingConfig, eos_token_ids):
    """(max_new_tokens, sampling, stop ids) of a request as Python numbers (a sampling setting a
    tuple where it is one a row), checked: a ValueError names the first that is not what it must be."""
    max_new_tokens = whole("max_new_tokens", max_new_tokens, 1)
    sampling = sampling.validate()
    if eos_token_ids is None:
        stops = params.config.eos_token_ids
    elif isinstance(eos_token_ids, (list, tuple, set)) or \
            isinstance(eos_token_ids, (np.ndarray, jax.Array)) and eos_token_ids.ndim == 1:
        # int32 like the ids; a negative one never matches (configs write -1 for "none")
        stops = tuple(whole("a stop id (eos_token_ids)", t, -INT32_MAX - 1) for t in eos_token_ids)
    else:
        raise ValueError(f"eos_token_ids must be a list of token ids or None, got {eos_token_ids!r}")
    return max_new_tokens, sampling, stops


def _plan(params: Params, ids, max_new_tokens: int, sampling: SamplingConfig, kv_dtype=None,
          allocated=None):
    """(tokens, start, steps, cache length) of a request, checked: `allocated(*plan)`, if given,
    is XLA's count of what the program that will run it allocates (see `check_fit`)."""
    cfg = params.config
    tokens, start, longest = pad_prompts(params, ids)
    sampling.check_batch(tokens.shape[0])
    if longest + max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(
            f"prompt of {longest} tokens plus max_new_tokens={max_new_tokens} is {longest + max_new_tokens}, "
            f"over the model's context of {cfg.max_position_embeddings} tokens")
    steps = bucket(max_new_tokens)
    check_kv_int8(params, is_int8(kv_dtype))
    plan = tokens, start, steps, tokens.shape[1] + steps
    check_fit(params, tokens.shape[0], tokens.shape[1], tokens.shape[1] + steps, kv_dtype,
              allocated=allocated and (lambda: allocated(*plan)))  # before allocating
    return plan


def generate(params: Params, ids, *, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, min_p: float = 0.0, repetition_penalty: float = 1.0,
             eos_token_ids: Sequence[int] | None = None, seed: int = 0, kv_dtype=None,
             presence_penalty: float = 0.0, frequency_penalty: float = 0.0, speculative=None,
             num_speculative: int | None = None, synthetic_acceptance: float | None = None) -> GenerateOutput:
    """Generate up to max_new_tokens per row; greedy at temperature 0. See DESIGN.md for the contract.

    `speculative`: "ngram" (prompt lookup) or a draft model's Params (same vocabulary) turns on
    speculative decoding (engine/speculative.py), `num_speculative` tokens proposed a round
    (None: 7 for ngram, 3 for a draft, switched off while the batch's acceptance is low). Greedy
    output is the same tokens; sampled output has the same law, but not the same tokens for a
    seed as without speculation. The output's `stats` (a `SpecStats`) then says how many drafts
    were accepted. `synthetic_acceptance` (benchmarks on random weights only: the output is
    meaningless) accepts each draft with that probability.

    Each sampling setting and `seed` is a number (every row) or a list of one value a row: a row
    gets the tokens it gets alone with its settings and seed, whatever the other rows ask (so rows
    of one prompt and one seed draw alike). Presence and frequency penalties are OpenAI's, over
    the tokens generated. `kv_dtype="int8"` keeps the KV cache in int8 with per-slot scales
    (default: the model dtype).
    """
    sampling = SamplingConfig(temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty,
                              frequency_penalty, seed)
    max_new_tokens, sampling, stops = _request(require_params(params), max_new_tokens, sampling, eos_token_ids)
    if speculative is not None:
        return _generate_speculative(params, ids, max_new_tokens, sampling, stops, kv_dtype, speculative,
                                     num_speculative, synthetic_acceptance)
    if num_speculative is not None or synthetic_acceptance is not None:
        raise ValueError("num_speculative and synthetic_acceptance need speculative ('ngram' or a draft model)")

    def call(tokens, start, steps, cache_length):  # the loop's arguments for this plan
        return (params, jnp.asarray(tokens), jnp.asarray(start),
                jnp.int32(max_new_tokens), _stop_array(stops), sampling.values(tokens.shape[0])), dict(
                    cache_length=cache_length, steps=steps, flags=sampling.static(),
                    kv_int8=is_int8(kv_dtype))

    def allocated(*plan):  # compiled once: the call below finds it in the jit's cache
        tokens, _, steps, cache_length = plan
        core = _core(tokens.shape[0], params)

        def compiled():
            args, static = call(*plan)
            return core.trace(*args, **static).lower().compile()
        return _counted(compiled, params, core, tokens.shape, len(stops), cache_length, steps,
                        sampling.static(), is_int8(kv_dtype))

    plan = _plan(params, ids, max_new_tokens, sampling, kv_dtype, allocated)
    tokens, _, steps, cache_length = plan
    core = _core(tokens.shape[0], params)
    args, static = call(*plan)
    compiled = compile_count(core)  # to warn when a new shape compiles again
    out, lengths = core(*args, **static)
    check_recompile(core, compiled, "generate", group=(params.config, params.dtype),
                    describe=lambda: shape_text(*tokens.shape, cache_length, steps, sampling))
    return GenerateOutput(tokens=out[:, :max_new_tokens], lengths=lengths)


_spec_cores = {options: jax.jit(spec_mod.spec_core, static_argnames=_STATIC + ("spec", "keep"),
                               compiler_options=_options(*options) or None)
               for options in _cores}


def _generate_speculative(params, ids, max_new_tokens, sampling, stops, kv_dtype, speculative,
                          num_speculative, synthetic) -> GenerateOutput:
    spec, aux = spec_mod.resolve(params, speculative, num_speculative, synthetic)
    tokens, start, steps, _ = _plan(params, ids, max_new_tokens, sampling, kv_dtype)
    cache_length = tokens.shape[1] + steps + spec.k + 1  # a round writes k+1 slots past the last kept
    if aux is not None and isinstance(aux, Params):
        _plan(aux, ids, max_new_tokens, sampling, kv_dtype)  # the draft's context and memory
    core = _spec_cores[_choice(tokens.shape[0], params)]
    compiled = compile_count(core)
    out, lengths, stats = core(params, aux, jnp.asarray(tokens), jnp.asarray(start), jnp.int32(max_new_tokens),
                               _stop_array(stops), sampling.values(tokens.shape[0]), cache_length=cache_length,
                               steps=steps, flags=sampling.static(), kv_int8=is_int8(kv_dtype), spec=spec)
    check_recompile(core, compiled, "speculative generate", group=(params.config, params.dtype, spec.k),
                    describe=lambda: shape_text(*tokens.shape, cache_length, steps, sampling))
    return GenerateOutput(tokens=out[:, :max_new_tokens], lengths=lengths,
                          stats=spec_mod.make_stats(spec.k, stats, lengths))


def _stream_speculative(params, ids, max_new_tokens, sampling, stops, kv_dtype, speculative, num_speculative):
    """`stream` with speculation: the loop of `generate`, run one round a call, each round's
    accepted tokens yielded; returns the SpecStats (the generator's return value)."""
    spec, aux = spec_mod.resolve(params, speculative, num_speculative)
    tokens, start, steps, _ = _plan(params, [list(ids)], max_new_tokens, sampling, kv_dtype)
    if isinstance(aux, Params):
        _plan(aux, [list(ids)], max_new_tokens, sampling, kv_dtype)
    cache_length = tokens.shape[1] + steps + spec.k + 1
    core = _spec_cores[_choice(1, params)]
    args = (params, aux, jnp.asarray(tokens), jnp.asarray(start), jnp.int32(max_new_tokens), _stop_array(stops),
            jax.device_put(sampling.values(1)))
    static = dict(cache_length=cache_length, steps=steps, flags=sampling.static(), kv_int8=is_int8(kv_dtype),
                  spec=spec, keep=True)
    carry = core(*args, None, jnp.int32(0), **static)[3]
    made = 0
    while True:
        out_W, done, count = (np.asarray(x[0]) for x in jax.device_get((carry[2], carry[3], carry[4])))
        for token in out_W[made:min(int(count), max_new_tokens)]:
            made += 1
            yield int(token)
            if int(token) in stops:
                return spec_mod.make_stats(spec.k, carry[7], [made])
        if done or made >= max_new_tokens:
            return spec_mod.make_stats(spec.k, carry[7], [made])
        carry = core(*args, carry, carry[0] + 1, **static)[3]


@partial(jax.jit, static_argnames=("flags",))
def _choose_jit(logits_BV, history, sampling, index, flags):
    return _choose(logits_BV, history, sampling, index, flags)


def stream(params: Params, ids: Sequence[int], *, max_new_tokens: int = 256, temperature: float = 0.0,
           top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, repetition_penalty: float = 1.0,
           eos_token_ids: Sequence[int] | None = None, seed: int = 0, kv_dtype=None,
           presence_penalty: float = 0.0, frequency_penalty: float = 0.0, speculative=None,
           num_speculative: int | None = None) -> Iterator[int]:
    """Yield the new token ids of one prompt as they are produced, the stop token included.

    `speculative` and `num_speculative` as in `generate`: each round's accepted tokens come at
    once, and the generator's return value (StopIteration.value) is then the `SpecStats`."""
    sampling = SamplingConfig(temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty,
                              frequency_penalty, seed)
    max_new_tokens, sampling, stops = _request(require_params(params), max_new_tokens, sampling, eos_token_ids)
    if not isinstance(ids, (list, tuple, np.ndarray, jax.Array)):
        raise ValueError(f"ids must be one prompt's token ids, a list, got {type(ids).__name__}")
    if isinstance(ids, (np.ndarray, jax.Array)) and ids.ndim != 1:
        raise ValueError(f"ids must be one prompt's token ids, a list, got an array of shape {ids.shape}")
    if speculative is not None:
        return (yield from _stream_speculative(params, ids, max_new_tokens, sampling, stops, kv_dtype,
                                               speculative, num_speculative))
    if num_speculative is not None:
        raise ValueError("num_speculative needs speculative ('ngram' or a draft model)")
    run = jitted_step()

    def new_cache(start, cache_length):
        return init_cache(params.config, 1, cache_length, params.dtype, start, kv_dtype=kv_dtype)

    def allocated(tokens, start, steps, cache_length):
        # The cache (an argument here) and XLA's count of the prefill, the largest step: compiled
        # once for abstract arguments, which the call below finds in the jit's cache.
        kv = memory.request_bytes(params, 1, tokens.shape[1], cache_length, kv_dtype)[0]

        def compiled():
            cache = jax.eval_shape(partial(new_cache, cache_length=cache_length),
                                   jax.ShapeDtypeStruct(start.shape, jnp.int32))
            return run.trace(params, jax.ShapeDtypeStruct(tokens.shape, jnp.int32), cache,
                             fresh=True).lower().compile()
        return kv + _counted(compiled, params, run, tokens.shape, cache_length, is_int8(kv_dtype))

    tokens, start, _, cache_length = _plan(params, [list(ids)], max_new_tokens, sampling, kv_dtype,
                                           allocated)
    stops = set(stops)
    flags, values = sampling.static(), jax.device_put(sampling.values())  # sent once, read every token
    cache = new_cache(jnp.asarray(start), cache_length)
    tokens_dev = jnp.asarray(tokens)
    history = _history(tokens_dev, cache.start, params.config.vocab_size, flags)
    rotation = rotation_table(params.config, cache_length) if params.tp is None else None
    compiled = compile_count(run)
    logits_BV, cache = run(params, tokens_dev, cache, fresh=True)
    check_recompile(run, compiled, "stream", group=(params.config, params.dtype),
                    describe=lambda: shape_text(*tokens.shape, cache_length))
    for i in range(max_new_tokens):
        token_B = _choose_jit(logits_BV, history, values, i, flags)
        token = int(token_B[0])
        yield token
        if token in stops or i + 1 == max_new_tokens:
            return
        if flags.repetition_penalty or flags.penalties:
            history = _record(history, token_B, jnp.ones((1,), bool))
        logits_BV, cache = run(params, token_B[:, None], cache, rotation=rotation)
