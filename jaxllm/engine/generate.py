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

from jaxllm import runtime
from jaxllm.engine import memory, speculative as spec_mod
from jaxllm.engine.compile import check_recompile, compile_count, kernels_visible, shape_text
from jaxllm.engine.memory import check_fit
from jaxllm.checks import INT32_MAX, token_ids, whole
from jaxllm.engine.sampling import (SamplingConfig, SamplingFlags, SamplingParams, choose, penalty_history,
                                    record)
from jaxllm.engine.steps import check_kv_int8
from jaxllm.env import env_flag
from jaxllm.layers import dense as L
from jaxllm.model.cache import init_cache, is_int8
from jaxllm.model.params import Params, is_quantized, require_params
from jaxllm.model.transformer import jitted_step, rotation_table, step
from jaxllm.runtime import AUTOTUNE_OPTIONS, LOOP_GRAPH_OPTIONS, ONE_ROW_OPTIONS

MIN_BUCKET = 16
STOP_SLOTS = 8  # stop ids are padded to a multiple of this, so their count does not recompile



# A prompt longer than this prefills in chunks of it, each a step over the cache the chunks before
# it filled: the attention scores of a chunk are [chunk, S] where the whole prompt's were [T, T],
# which grew to gigabytes for prompts of thousands of tokens (cuDNN's fused prefill never forms
# them: it keeps one prefill). Buckets above 1024 are multiples of 1024, so the chunks divide them.
PREFILL_CHUNK = 1024
PROGRESS_AFTER_S = 2.0  # a prefill still running after this long shows its progress on a terminal


class GenerateOutput(NamedTuple):
    tokens: jax.Array  # int32 [B, max_new_tokens]; the pad id after a row stops
    lengths: jax.Array  # int32 [B]: new tokens per row, the stop token included
    stats: "spec_mod.SpecStats | None" = None  # with `speculative`: acceptance and tokens per step


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
    rows = token_ids(ids, cfg.vocab_size, ragged=True)
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






def prefill_chunk(width: int, params: Params) -> int | None:
    """The chunk a prompt `width` tokens wide (a bucket) prefills in, None for one fresh prefill:
    also where cuDNN's fused attention prefills it, which never forms the [T, T] scores."""
    if L.uses_cudnn_attention(params.dtype, params.config.head_dim):
        return None
    return PREFILL_CHUNK if width > PREFILL_CHUNK and width % PREFILL_CHUNK == 0 else None


class _Progress:
    """'jaxllm: prefill 3072/8192 tokens' on stderr while a long prefill runs, only on a terminal
    and only once it has run PROGRESS_AFTER_S; the line is erased when the prefill is done."""
    started, shown = 0.0, False

    @classmethod
    def update(cls, done: int, total: int) -> None:
        import sys
        import time
        now, done = time.monotonic(), int(done)
        if done == 0:
            cls.started, cls.shown = now, False
        if done < total and now - cls.started >= PROGRESS_AFTER_S:
            sys.stderr.write(f"\rjaxllm: prefill {done}/{total} tokens")
            sys.stderr.flush()
            cls.shown = True
        elif done == total and cls.shown:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def _show_progress() -> bool:
    import sys
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed
        return False


def _chunked_prefill(params: Params, tokens_BT, cache, chunk: int, progress: bool = False):
    """The prompt's prefill in chunks of `chunk` tokens, each a step over what the chunks before
    it wrote (left padding stays unseen: it lies before each row's start); (logits [B, V], cache)
    as `step(..., fresh=True)` returns them."""
    B, T = tokens_BT.shape
    chunks_NBC = tokens_BT.reshape(B, T // chunk, chunk).transpose(1, 0, 2)

    def body(cache, x):
        i, chunk_BC = x
        if progress:
            jax.debug.callback(partial(_Progress.update, total=T), i * chunk)
        logits_BV, cache = step(params, chunk_BC, cache)
        return cache, logits_BV

    cache, logits_NBV = jax.lax.scan(body, cache, (jnp.arange(T // chunk, dtype=jnp.int32), chunks_NBC))
    if progress:
        # after the last chunk: its logits are the callback's argument
        jax.debug.callback(lambda _: _Progress.update(T, T), logits_NBV[-1, 0, 0])
    return logits_NBV[-1], cache


def _generate_core_fn(params: Params, tokens_BT, start_B, max_new, stop_ids, sampling: SamplingParams, *,
                      cache_length: int, steps: int, flags: SamplingFlags, kv_int8: bool = False,
                      chunk: int | None = None, progress: bool = False):
    cfg = params.config
    B = tokens_BT.shape[0]
    pad = jnp.int32(cfg.pad_id)
    cache = init_cache(cfg, B, cache_length, params.dtype, start_B, kv_dtype="int8" if kv_int8 else None)
    history = penalty_history(tokens_BT, start_B, cfg.vocab_size, flags)
    if chunk is None:
        logits_BV, cache = step(params, tokens_BT, cache, fresh=True)
    else:
        logits_BV, cache = _chunked_prefill(params, tokens_BT, cache, chunk, progress)
    token_B = choose(logits_BV, history, sampling, 0, flags)
    out_BN = jnp.full((B, steps), pad, jnp.int32).at[:, 0].set(token_B)
    done_B = _is_stop(token_B, stop_ids)
    history = record(history, token_B, jnp.ones((B,), bool))

    def cond(carry):
        i, _, _, _, done_B, _ = carry
        return (i < max_new) & ~jnp.all(done_B)

    # A step's bookkeeping is only what the loop needs: the token, its stop test (for the loop's
    # condition) and the output write. The lengths and the padding after each row's stop token
    # follow from the tokens once, after the loop: every small op in the loop is a kernel of its
    # own in every step (docs/decisions/loop-and-compiler.md#only-what-the-loop-needs-inside-it).
    # The decode kernel's cos and sin by position, once (sharded steps make theirs per step)
    rotation = rotation_table(cfg, cache_length) if params.tp is None else None

    def body(carry):
        i, token_B, cache, out_BN, done_B, history = carry
        logits_BV, cache = step(params, token_B[:, None], cache, rotation=rotation)
        new_B = choose(logits_BV, history, sampling, i, flags)
        out_BN = jax.lax.dynamic_update_slice(out_BN, new_B[:, None], (jnp.int32(0), i))
        history = record(history, new_B, ~done_B)
        return i + 1, new_B, cache, out_BN, done_B | _is_stop(new_B, stop_ids), history

    carry = (jnp.int32(1), token_B, cache, out_BN, done_B, history)
    made, _, _, out_BN, _, _ = jax.lax.while_loop(cond, body, carry)
    # A row's length runs to its first stop token (included), else to the steps made; a done
    # row's later steps (whose tokens no one reads) become padding.
    n_N = jnp.arange(steps, dtype=jnp.int32)
    stop_BN = _is_stop(out_BN, stop_ids) & (n_N < made)
    lengths_B = jnp.where(jnp.any(stop_BN, axis=1), jnp.argmax(stop_BN, axis=1) + 1, made)
    return jnp.where(n_N < lengths_B[:, None], out_BN, pad), lengths_B.astype(jnp.int32)


_STATIC = ("cache_length", "steps", "flags", "kv_int8", "chunk", "progress")


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
              and runtime.gpu_generation() > 0 and "xla_gpu_enable_triton_gemm" not in flags
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
# arguments). A warm call pays that key, not a trace and lowering found in the jit's caches nor a
# second set of the loop's argument arrays (docs/decisions/loop-and-compiler.md#the-memory-checks-cost).
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
                    kv_int8=is_int8(kv_dtype), chunk=prefill_chunk(tokens.shape[1], params),
                    progress=prefill_chunk(tokens.shape[1], params) is not None and _show_progress())

    def allocated(*plan):  # compiled once: the call below finds it in the jit's cache
        tokens, _, steps, cache_length = plan
        core = _core(tokens.shape[0], params)

        def compiled():
            args, static = call(*plan)
            return core.trace(*args, **static).lower().compile()
        return _counted(compiled, params, core, tokens.shape, len(stops), cache_length, steps,
                        sampling.static(), is_int8(kv_dtype), prefill_chunk(tokens.shape[1], params))

    plan = _plan(params, ids, max_new_tokens, sampling, kv_dtype, allocated)
    tokens, _, steps, cache_length = plan
    core = _core(tokens.shape[0], params)
    args, static = call(*plan)
    compiled = compile_count(core)  # to warn when a new shape compiles again
    out, lengths = core(*args, **static)
    check_recompile(core, compiled, "generate", group=(params.config, params.dtype),
                    describe=lambda: shape_text(*tokens.shape, cache_length, steps, sampling))
    return GenerateOutput(tokens=out[:, :max_new_tokens], lengths=lengths)


_spec_cores = {options: jax.jit(spec_mod.spec_core, static_argnames=_STATIC[:4] + ("spec", "keep"),
                               compiler_options=_options(*options) or None)
               for options in _cores}


def spec_cache_length(prompt: int, steps: int, k: int) -> int:
    """The cache slots of a speculative run: prompt + steps + k + 1 (a round writes k + 1 slots past
    the last kept; prompt + steps, both buckets, are whole blocks already), in whole blocks."""
    return spec_mod.whole_blocks(prompt + steps + k + 1)


def _generate_speculative(params, ids, max_new_tokens, sampling, stops, kv_dtype, speculative,
                          num_speculative, synthetic) -> GenerateOutput:
    spec, aux = spec_mod.resolve(params, speculative, num_speculative, synthetic)
    tokens, start, steps, _ = _plan(params, ids, max_new_tokens, sampling, kv_dtype)
    if not spec_mod.speculates(spec, tokens.shape[0]):  # the default stops at SpecTuning.batch_limit rows
        out = generate(params, ids, max_new_tokens=max_new_tokens, eos_token_ids=list(stops), kv_dtype=kv_dtype,
                       **sampling._asdict())
        return out._replace(stats=spec_mod.plain_stats(spec.k, out.lengths))
    cache_length = spec_cache_length(tokens.shape[1], steps, spec.k)
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
    cache_length = spec_cache_length(tokens.shape[1], steps, spec.k)
    core = _spec_cores[_choice(1, params)]
    args = (params, aux, jnp.asarray(tokens), jnp.asarray(start), jnp.int32(max_new_tokens), _stop_array(stops),
            jax.device_put(sampling.values(1)))
    static = dict(cache_length=cache_length, steps=steps, flags=sampling.static(), kv_int8=is_int8(kv_dtype),
                  spec=spec, keep=True)
    carry = core(*args, None, jnp.int32(0), **static)[3]
    width, made = tokens.shape[1], 0
    while True:
        out_W, done, count = (np.asarray(x[0]) for x in jax.device_get((carry.seq_BS[:, width:], carry.done_B,
                                                                        carry.count_B)))
        for token in out_W[made:min(int(count), max_new_tokens)]:
            made += 1
            yield int(token)
            if int(token) in stops:
                return spec_mod.make_stats(spec.k, spec_mod.totals(carry), [made])
        if done or made >= max_new_tokens:
            return spec_mod.make_stats(spec.k, spec_mod.totals(carry), [made])
        carry = core(*args, carry, carry.r + 1, **static)[3]


@partial(jax.jit, static_argnames=("flags",))
def _choose_jit(logits_BV, history, sampling, index, flags):
    return choose(logits_BV, history, sampling, index, flags)


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
    ids = token_ids(ids, params.config.vocab_size, one=True)
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

        chunk = prefill_chunk(tokens.shape[1], params)
        shape = tokens.shape if chunk is None else (tokens.shape[0], chunk)

        def compiled():
            cache = jax.eval_shape(partial(new_cache, cache_length=cache_length),
                                   jax.ShapeDtypeStruct(start.shape, jnp.int32))
            return run.trace(params, jax.ShapeDtypeStruct(shape, jnp.int32), cache,
                             fresh=chunk is None).lower().compile()
        return kv + _counted(compiled, params, run, shape, cache_length, is_int8(kv_dtype), chunk is None)

    tokens, start, _, cache_length = _plan(params, [ids], max_new_tokens, sampling, kv_dtype,
                                           allocated)
    stops = set(stops)
    flags, values = sampling.static(), jax.device_put(sampling.values())  # sent once, read every token
    cache = new_cache(jnp.asarray(start), cache_length)
    tokens_dev = jnp.asarray(tokens)
    history = penalty_history(tokens_dev, cache.start, params.config.vocab_size, flags)
    rotation = rotation_table(params.config, cache_length) if params.tp is None else None
    compiled = compile_count(run)
    chunk = prefill_chunk(tokens.shape[1], params)
    if chunk is None:
        logits_BV, cache = run(params, tokens_dev, cache, fresh=True)
    else:  # a few calls of one program, as `_chunked_prefill` does inside generate's
        progress, width = _show_progress(), tokens.shape[1]
        for done in range(0, width, chunk):
            if progress:
                _Progress.update(done, width)
            logits_BV, cache = run(params, tokens_dev[:, done:done + chunk], cache)
            if progress:
                jax.block_until_ready(logits_BV)  # the progress shown is what was done
        if progress:
            _Progress.update(width, width)
    check_recompile(run, compiled, "stream", group=(params.config, params.dtype),
                    describe=lambda: shape_text(*tokens.shape, cache_length))
    for i in range(max_new_tokens):
        token_B = _choose_jit(logits_BV, history, values, i, flags)
        token = int(token_B[0])
        yield token
        if token in stops or i + 1 == max_new_tokens:
            return
        if flags.repetition_penalty or flags.penalties:
            history = record(history, token_B, jnp.ones((1,), bool))
        logits_BV, cache = run(params, token_B[:, None], cache, rotation=rotation)
