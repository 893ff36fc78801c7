"""generate's contract: ragged batches, stop ids, shape buckets, seeds, and its streaming twin."""

import dataclasses
import importlib
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxllm
from jaxllm.engine.generate import _generate_core, pad_prompts
from jaxllm import runtime
from jaxllm.model import transformer as model
from jaxllm.model.params import quantize_params
from tiny_models import hf_greedy, rel_err, random_tokens
from compile_counting import compilations

NEW = 20  # with a [2, 12] prompt: the shapes test_parity's greedy test compiled already


@pytest.mark.slow
def test_ragged_batch_rows_equal_rows_alone(tiny):
    params = tiny("qwen2_swa").params  # a full-attention layer, then sliding ones
    prompts = [random_tokens(n, seed=n).tolist() for n in (5, 13, 20)]
    out = jaxllm.generate(params, prompts, max_new_tokens=16, eos_token_ids=[])
    assert out.tokens.shape == (3, 16)
    for b, prompt in enumerate(prompts):
        alone = jaxllm.generate(params, np.array([prompt], np.int32), max_new_tokens=16, eos_token_ids=[])
        np.testing.assert_array_equal(out.tokens[b], alone.tokens[0], err_msg=f"row {b}")
    np.testing.assert_array_equal(out.lengths, [16, 16, 16])


@pytest.mark.slow
def test_ragged_prefill_and_decode_logits_match_each_row_alone(tiny):
    """Left padding plus per-row positions: every row's logits are transformers' for that row."""
    m = tiny("mistral")  # a 4-token window, so masks of padding and window interact
    rows = [random_tokens(n, seed=10 + n) for n in (3, 9, 14)]
    continuation = random_tokens((3, 4), seed=9)
    tokens, start, _ = pad_prompts(m.params, [r.tolist() for r in rows])
    cache = jaxllm.init_cache(m.params.config, 3, tokens.shape[1] + 4, m.params.dtype, start=start)
    logits, cache = jaxllm.prefill(m.params, tokens, cache)
    steps = [logits]
    for t in range(3):
        logits, cache = jaxllm.decode_step(m.params, continuation[:, t], cache)
        steps.append(logits)
    got_BTV = np.stack(steps, axis=1)
    for b, row in enumerate(rows):
        ref = m.hf_logits(np.concatenate([row, continuation[b, :3]])[None])[0, len(row) - 1:]
        assert rel_err(got_BTV[b], ref) < 1e-4, f"row {b}"


@pytest.mark.slow
def test_a_second_prefill_reads_what_the_first_wrote(tiny):
    """A prompt into an empty cache attends among its own tokens (rotated rows, no cache read); a
    later block of tokens reads that cache through the masks: their logits are transformers'."""
    m = tiny("mistral")  # a 4-token window across the two blocks
    rows = [random_tokens(n, seed=20 + n) for n in (2, 7, 13)]
    more = random_tokens((3, 5), seed=8)
    tokens, start, _ = pad_prompts(m.params, [r.tolist() for r in rows])
    cache = jaxllm.init_cache(m.params.config, 3, tokens.shape[1] + 8, m.params.dtype, start=start)
    first, cache = jaxllm.prefill(m.params, tokens, cache)
    second, cache = jaxllm.prefill(m.params, more, cache)
    for b, row in enumerate(rows):
        ref = m.hf_logits(np.concatenate([row, more[b]])[None])[0]
        assert rel_err(first[b], ref[len(row) - 1]) < 1e-4, f"row {b}"
        assert rel_err(second[b], ref[-1]) < 1e-4, f"row {b}"


def _first_new(row, k_min=2):
    """(index, token) of the first token at index >= k_min that did not occur earlier in row."""
    for k in range(k_min, len(row)):
        if row[k] not in row[:k]:
            return k, int(row[k])
    raise AssertionError(f"no fresh token in {row}")


@pytest.fixture(scope="module")
def free_run(llama):
    """Greedy tokens of a [2, 12] prompt with no stop id at all."""
    prompt = random_tokens((2, 12), seed=3)
    out = jaxllm.generate(llama.params, prompt, max_new_tokens=NEW, eos_token_ids=[])
    np.testing.assert_array_equal(out.lengths, [NEW, NEW])
    return prompt, np.asarray(out.tokens)


def _stop_pair(free):
    """(k0, x, k1, y): row 0's first x at k0 >= 2 and row 1's first y at k1 >= k0 + 2 (it stops
    later), neither found in the other row up to that row's stop."""
    for k0 in range(2, free.shape[1]):
        x = int(free[0, k0])
        if x in free[0, :k0]:
            continue
        for k1 in range(k0 + 2, free.shape[1]):
            y = int(free[1, k1])
            if y != x and y not in free[1, :k1] and x not in free[1, :k1 + 1] and y not in free[0, :k0 + 1]:
                return k0, x, k1, y
    raise AssertionError(f"no two stop ids tell these rows apart: {free}")


def test_each_row_stops_at_its_own_stop_id(llama, free_run):
    prompt, free = free_run
    k0, x, k1, y = _stop_pair(free)
    out = jaxllm.generate(llama.params, prompt, max_new_tokens=NEW, eos_token_ids=[x, y])
    tokens, pad = np.asarray(out.tokens), llama.params.config.pad_id
    np.testing.assert_array_equal(out.lengths, [k0 + 1, k1 + 1])  # the stop token is counted
    for b, k in enumerate((k0, k1)):
        np.testing.assert_array_equal(tokens[b, :k + 1], free[b, :k + 1])
        assert (tokens[b, k + 1:] == pad).all(), f"row {b} is not padded after its stop"


def test_stop_ids_none_means_the_configs_and_empty_means_never(llama, free_run):
    prompt, free = free_run
    k, x = _first_new(free[0], 3)
    params = llama.params.replace(config=dataclasses.replace(llama.params.config, eos_token_ids=(x,)))
    out = jaxllm.generate(params, prompt[:1], max_new_tokens=NEW, eos_token_ids=None)
    assert int(out.lengths[0]) == k + 1
    np.testing.assert_array_equal(out.tokens[0, :k + 1], free[0, :k + 1])
    out = jaxllm.generate(params, prompt[:1], max_new_tokens=NEW, eos_token_ids=[])
    assert int(out.lengths[0]) == NEW
    np.testing.assert_array_equal(out.tokens[0], free[0])


def test_stop_ids_are_read_from_generation_config(llama, tmp_path):
    assert llama.params.config.eos_token_ids == (2,)
    shutil.copytree(llama.path, tmp_path, dirs_exist_ok=True)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 9]}))
    assert jaxllm.load(tmp_path, dtype="float32").config.eos_token_ids == (5, 9)


@pytest.mark.slow
def test_new_lengths_within_a_bucket_compile_nothing(llama):
    params = llama.params
    jaxllm.generate(params, random_tokens((1, 5)), max_new_tokens=9, temperature=0.8, top_k=20)
    cached = _generate_core._cache_size()
    with compilations() as compiled:
        # Another prompt length in the same bucket, other sampling values, another seed.
        jaxllm.generate(params, random_tokens((1, 11), seed=1), max_new_tokens=9, temperature=0.6,
                        top_k=7, seed=3).tokens.block_until_ready()
    assert compiled == [] and _generate_core._cache_size() == cached
    with compilations() as compiled:
        # Another max_new_tokens in the same bucket reuses the program (only trimming the
        # output to the new width may compile a slice).
        jaxllm.generate(params, random_tokens((1, 14), seed=2), max_new_tokens=13, temperature=0.6,
                        top_k=7).tokens.block_until_ready()
    assert _generate_core._cache_size() == cached
    assert all("generate" not in name for name in compiled), compiled
    with compilations() as compiled:  # the next prompt bucket does compile: the counter counts
        jaxllm.generate(params, random_tokens((1, 17)), max_new_tokens=9, temperature=0.8, top_k=20)
    assert any("generate" in name for name in compiled), compiled
    assert _generate_core._cache_size() == cached + 1


# The next tests sample with top_k=20, one prompt of at most 16 tokens and at most 16 new ones:
# the program test_new_lengths_within_a_bucket_compile_nothing compiled.
SAMPLED = dict(max_new_tokens=16, temperature=1.0, top_k=20, eos_token_ids=[])


def test_same_seed_same_tokens_other_seed_other_tokens(llama):
    prompt = random_tokens((1, 12), seed=3)
    a, b, c = (np.asarray(jaxllm.generate(llama.params, prompt, seed=s, **SAMPLED).tokens) for s in (7, 7, 8))
    np.testing.assert_array_equal(a, b)
    assert (a != c).mean() > 0.5


def test_stream_yields_what_generate_returns(llama):
    prompt = random_tokens(12, seed=3).tolist()
    streamed = list(jaxllm.stream(llama.params, prompt, seed=5, **SAMPLED))
    generated = jaxllm.generate(llama.params, [prompt], seed=5, **SAMPLED).tokens[0]
    np.testing.assert_array_equal(streamed, generated)


def test_stream_stops_after_the_stop_token(llama, free_run):
    prompt, free = free_run
    k, x = _first_new(free[0], 2)
    assert k < 15
    streamed = list(jaxllm.stream(llama.params, prompt[0].tolist(), max_new_tokens=16, eos_token_ids=[x]))
    assert streamed == free[0, :k + 1].tolist()


def _repeats(tokens) -> int:
    return sum(len(row) - len(set(row.tolist())) for row in np.asarray(tokens))


@pytest.mark.slow
def test_repetition_penalty_matches_transformers_and_lowers_repeats(llama, free_run):
    prompt, free = free_run
    out = jaxllm.generate(llama.params, prompt, max_new_tokens=NEW, repetition_penalty=1.8)
    ref, lengths = hf_greedy(llama.hf, llama.params.config, prompt, NEW, repetition_penalty=1.8)
    np.testing.assert_array_equal(out.tokens, ref)
    np.testing.assert_array_equal(out.lengths, lengths)
    assert _repeats(free) > 0 and _repeats(out.tokens) < _repeats(free)


def test_a_step_traces_each_kind_of_layer_once(llama, monkeypatch):
    """Layers of one shape share one trace (model._block), so a first call's Python tracing does
    not grow with depth: it was half of the 8B shape's warm-cache first call on an H200."""
    from jaxllm.model import transformer as model
    from jaxllm.model.cache import init_cache

    traced = []
    real = model._attention_block
    monkeypatch.setattr(model, "_attention_block", lambda *a, **k: traced.append(1) or real(*a, **k))
    model._block.clear_cache()
    params = llama.params
    assert len(params.layers) == 3
    # A prefill's last layer is a kind of its own (no norm follows it: the final norm takes the
    # last position only); in a decode step it feeds the final norm like the others the next qkv.
    for fresh, T, kinds in ((True, 8, 2), (False, 1, 1)):
        cache = init_cache(params.config, 1, 16, params.dtype)
        traced.clear()
        jax.jit(model.step, static_argnames="fresh").trace(
            params, jnp.zeros((1, T), jnp.int32), cache, fresh=fresh)
        assert len(traced) == kinds, (fresh, len(traced))


_JIT_SPY = """
import json, jax
options, jit = {}, jax.jit
def spy(fun=None, **kwargs):  # what each of the model's jits is given
    options.setdefault(getattr(fun, "__name__", "?"), []).append(kwargs.get("compiler_options"))
    return jit(fun, **kwargs)
jax.jit = spy
from jaxllm.engine import generate
from jaxllm.model import transformer as model
model.jitted_step()
print(json.dumps({name: options[name] for name in ("_forward", "step", "_generate_core_fn")}))
"""


@pytest.mark.slow
def test_model_programs_leave_out_xlas_fusion_autotuner_unless_xla_flags_name_it():
    """model.AUTOTUNE_OPTIONS (the fusion autotuner off, small redzones: a cold compile's peak
    memory on a GPU) go to each of the model's programs, which the tests compile on the CPU, whose
    XLA rejects an option it does not know; an option the user's XLA_FLAGS name is theirs."""
    options = {"xla_gpu_experimental_enable_fusion_autotuner": False,
               "xla_gpu_redzone_padding_bytes": 1 << 16}
    for flags, want in (("", options), ("--xla_gpu_redzone_padding_bytes=8388608",
                                        {"xla_gpu_experimental_enable_fusion_autotuner": False})):
        out = subprocess.run([sys.executable, "-c", _JIT_SPY], capture_output=True, text=True,
                             timeout=120, env={**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"})
        assert out.returncode == 0, out.stderr[-2000:]
        given = json.loads(out.stdout.splitlines()[-1])
        assert len(given["_generate_core_fn"]) == 4, given  # graph or not, cuBLAS only or not
        for name, jits in given.items():
            for compiler_options in jits:
                assert want.items() <= compiler_options.items(), (flags, name, compiler_options)
                assert ("xla_gpu_redzone_padding_bytes" in compiler_options) == (not flags), name


@pytest.mark.slow
def test_one_row_of_a_dense_model_on_a_gpu_takes_cublas_gemms_only(llama, monkeypatch):
    """generate.ONE_ROW_OPTIONS: a batch-1 generate of a dense model on a GPU skips the autotuning
    of XLA's Triton GEMMs (seconds of a cold compile); more rows, MoE models, int8 weights, CPUs
    and XLA_FLAGS that name the option keep XLA's pick. XLA rejects an option it does not know,
    so running the one-row program here also checks the option's name; its tokens are the
    default's."""
    gen = importlib.import_module("jaxllm.engine.generate")  # the module; `jaxllm.generate` is the function
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.delenv("JAXLLM_LOOP_GRAPH", raising=False)
    dense = llama.params
    moe = dense.replace(config=dataclasses.replace(dense.config, num_experts=4, experts_per_token=2))
    one_row = gen._cores[True, True]
    assert gen._core(1, dense) is gen._generate_core  # on this CPU
    with monkeypatch.context() as m:
        m.setattr(runtime, "gpu_generation", lambda: 9)
        assert gen._core(1, dense) is one_row
        # What bench compiles its prefill with: the options of the loop generate picked.
        assert gen.compiler_options(1, dense) == {**model.AUTOTUNE_OPTIONS, **gen.LOOP_GRAPH_OPTIONS,
                                                  **gen.ONE_ROW_OPTIONS}
        assert "xla_gpu_enable_triton_gemm" not in gen.compiler_options(2, dense)
        assert gen._core(2, dense) is gen._generate_core
        assert gen._core(1, moe) is gen._generate_core
        assert gen._core(1, quantize_params(dense)) is gen._generate_core
        m.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true")
        assert gen._core(1, dense) is gen._generate_core
    prompt = random_tokens((1, 7), seed=4)
    want = jaxllm.generate(llama.params, prompt, max_new_tokens=8, eos_token_ids=[]).tokens
    monkeypatch.setattr(gen, "_core", lambda *a: one_row)
    got = jaxllm.generate(llama.params, prompt, max_new_tokens=8, eos_token_ids=[]).tokens
    np.testing.assert_array_equal(got, want)


def test_jax_and_numpy_scalars_are_taken_as_sampling_settings(llama):
    """A JAX or numpy scalar is a number like any other (a JAX one was unhashable in the static
    flags); an array of other than one value a row is refused by name."""
    prompt = random_tokens((1, 12), seed=3)
    want = jaxllm.generate(llama.params, prompt, seed=5, **SAMPLED).tokens
    settings = dict(SAMPLED, temperature=jnp.float32(1.0), top_k=jnp.int32(20), top_p=jnp.float32(1.0),
                    min_p=np.float32(0.0), repetition_penalty=jnp.float32(1.0))
    np.testing.assert_array_equal(jaxllm.generate(llama.params, prompt, seed=5, **settings).tokens, want)
    assert list(jaxllm.stream(llama.params, prompt[0].tolist(), seed=5, **settings)) == np.asarray(want)[0].tolist()
    greedy = jaxllm.generate(llama.params, prompt, max_new_tokens=4, temperature=0.0).tokens
    np.testing.assert_array_equal(
        jaxllm.generate(llama.params, prompt, max_new_tokens=4, temperature=jnp.float32(0)).tokens, greedy)
    for name, value in dict(temperature=0.5, top_k=5, top_p=0.5, min_p=0.5, repetition_penalty=0.5).items():
        with pytest.raises(ValueError, match=rf"{name} must be a number or a list of 1 \(one a row\), got 2 values"):
            jaxllm.generate(llama.params, prompt, max_new_tokens=4, **{name: jnp.array([value, value])})
        kind = "an integer" if name == "top_k" else "a number"
        with pytest.raises(ValueError, match=rf"{name} must be {kind}, got an array of shape \(1, 2\)"):
            jaxllm.generate(llama.params, prompt, max_new_tokens=4, **{name: jnp.array([[value, value]])})


def test_rows_given_as_jax_arrays_are_a_ragged_batch(llama):
    """Prompts of different lengths as JAX arrays are padded like lists or numpy arrays; a nested
    list is named, not left to numpy's "inhomogeneous shape"."""
    prompts = [random_tokens(n, seed=n) for n in (3, 7)]
    want = jaxllm.generate(llama.params, [p.tolist() for p in prompts], max_new_tokens=4).tokens
    got = jaxllm.generate(llama.params, [jnp.asarray(p) for p in prompts], max_new_tokens=4).tokens
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match=r"prompt 0 must be a flat list of token ids: it holds a nested list"):
        jaxllm.generate(llama.params, [[5, [6]]], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"ids must be a \[B, T\] array or a list of token lists"):
        jaxllm.generate(llama.params, [5, [6]], max_new_tokens=4)


@pytest.mark.parametrize("stop", [5, np.array(5), jnp.array(5)], ids=["int", "numpy 0-d", "jax 0-d"])
def test_a_0d_array_is_refused_where_a_plain_int_is(llama, stop):
    with pytest.raises(ValueError, match=r"eos_token_ids must be a list of token ids or None"):
        jaxllm.generate(llama.params, [[5, 6, 7]], max_new_tokens=4, eos_token_ids=stop)
    with pytest.raises(ValueError, match=r"ids must be one prompt's token ids, a list"):
        next(jaxllm.stream(llama.params, stop, max_new_tokens=4))


@pytest.mark.parametrize("ids, message", [
    (np.array([[]]), r"prompt 0 is empty"),  # numpy's empty array is float64
    (np.zeros((0, 3)), r"batch of 0"),
])
def test_an_empty_array_is_reported_as_empty_not_by_its_dtype(llama, ids, message):
    with pytest.raises(ValueError, match=message):
        jaxllm.generate(llama.params, ids, max_new_tokens=4)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=1e39), r"temperature must be .*a normal float32 number.*got 1e\+39"),  # inf there
    (dict(temperature=1e-40), r"temperature must be .*a normal float32 number.*got 1e-40"),
    (dict(repetition_penalty=1e-46), r"repetition_penalty must be .*normal float32.*got 1e-46"),  # 0 there
    (dict(top_p=1e-46), r"top_p must be .*normal float32.*got 1e-46"),
    (dict(min_p=1e-40), r"min_p must be .*normal float32.*got 1e-40"),
    (dict(max_new_tokens=True), r"max_new_tokens must be an integer, got True \(a bool\)"),
    (dict(seed=True), r"seed must be an integer, got True \(a bool\)"),
    (dict(top_k=True), r"top_k must be an integer, got True \(a bool\)"),
    (dict(temperature=np.True_), r"temperature must be a number, got np.True_ \(a bool\)"),
    (dict(eos_token_ids=[True]), r"stop id \(eos_token_ids\) must be an integer, got True \(a bool\)"),
])
def test_values_float32_cannot_hold_and_bools_are_refused(llama, kwargs, message):
    kwargs = dict(max_new_tokens=4) | kwargs
    with pytest.raises(ValueError, match=message):
        jaxllm.generate(llama.params, [[5, 6, 7]], **kwargs)
    with pytest.raises(ValueError, match=message):
        next(jaxllm.stream(llama.params, [5, 6, 7], **kwargs))


def test_a_bool_is_not_a_token_id(llama):
    with pytest.raises(ValueError, match=r"token ids must be integers, got True \(a bool\) at position 1 of prompt 0"):
        jaxllm.generate(llama.params, [[5, True]], max_new_tokens=4)  # numpy would make it token 1


def test_a_long_stop_list_is_one_comparison(llama, free_run):
    """A stop test's compares do not grow with the list (one each, unrolled, compiled in time that
    grew with it: 2000 ids took 38 s); negative ids still never match and the row stops at its id."""
    gen = importlib.import_module("jaxllm.engine.generate")  # the module; `jaxllm.generate` is the function
    tokens = jnp.zeros((2, 16), jnp.int32)

    def compares(n):
        return jax.jit(gen._is_stop).lower(tokens, gen._stop_array(list(range(n)))).as_text().count("compare")
    assert compares(2000) == compares(9) <= gen.STOP_SLOTS
    prompt, free = free_run
    k, x = _first_new(free[0], 3)
    stops = list(range(-1000, 0)) + [x] + list(range(2 ** 20, 2 ** 20 + 1000))
    out = jaxllm.generate(llama.params, prompt[:1], max_new_tokens=NEW, eos_token_ids=stops)
    assert int(out.lengths[0]) == k + 1
    np.testing.assert_array_equal(out.tokens[0, :k + 1], free[0, :k + 1])


def test_seeds_differ_past_32_bits(llama):
    """Seeds are 64-bit: 0 and 2**32, or -1 and 2**32 - 1, drew the same tokens (only the low 32
    bits reached the key); seeds below 2**32 draw what they drew before."""
    prompt = random_tokens((1, 12), seed=3)

    def draw(seed):
        return np.asarray(jaxllm.generate(llama.params, prompt, seed=seed, **SAMPLED).tokens)
    assert not np.array_equal(draw(0), draw(2**32))
    assert not np.array_equal(draw(-1), draw(2**32 - 1))
    from jaxllm.engine.sampling import seed_key, seed_words
    key = seed_key(jnp.asarray(seed_words(7), jnp.uint32))
    assert jax.random.key_data(key).tolist() == jax.random.key_data(jax.random.key(7)).tolist()
    np.testing.assert_array_equal(draw(2**32 + 7), draw(2**32 + 7))


def test_rows_with_their_own_sampling_settings_and_seeds_get_what_they_get_alone(llama):
    """Per-row temperature, top_k, top_p, min_p and seed in one batch (one program): each row gets
    exactly the tokens it gets alone, in whichever row it sits; a greedy row gets plain greedy."""
    prompts = [random_tokens(n, seed=40 + n).tolist() for n in (5, 12, 9, 16)]
    rows = [dict(temperature=0.7, top_k=20, top_p=1.0, min_p=0.0, seed=1),
            dict(temperature=1.3, top_k=0, top_p=0.9, min_p=0.0, seed=2),
            dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=3),
            dict(temperature=1.0, top_k=5, top_p=0.8, min_p=0.1, seed=2 ** 40 + 5)]
    run = dict(max_new_tokens=16, eos_token_ids=[])

    def batch(order):
        settings = {name: [rows[b][name] for b in order] for name in rows[0]}
        return np.asarray(jaxllm.generate(llama.params, [prompts[b] for b in order], **settings, **run).tokens)
    together = batch([0, 1, 2, 3])
    for b, settings in enumerate(rows):
        alone = jaxllm.generate(llama.params, [prompts[b]], **settings, **run).tokens[0]
        np.testing.assert_array_equal(together[b], alone, err_msg=f"row {b}: {settings}")
    np.testing.assert_array_equal(together[2], jaxllm.generate(llama.params, [prompts[2]], **run).tokens[0])
    np.testing.assert_array_equal(batch([3, 1, 0, 2]), together[[3, 1, 0, 2]])
    assert len({tuple(r) for r in together}) == 4


def test_a_seed_draws_alike_in_any_row_and_other_seeds_differ(llama):
    """One prompt in every row: rows of one seed (an int is every row's) draw the same tokens,
    rows of other seeds other tokens."""
    prompt = random_tokens(12, seed=3).tolist()
    same = np.asarray(jaxllm.generate(llama.params, [prompt] * 3, seed=7, **SAMPLED).tokens)
    listed = np.asarray(jaxllm.generate(llama.params, [prompt] * 3, seed=[7, 8, 7], **SAMPLED).tokens)
    alone = np.asarray(jaxllm.generate(llama.params, [prompt], seed=7, **SAMPLED).tokens)
    for row in (*same, listed[0], listed[2]):
        np.testing.assert_array_equal(row, alone[0])
    assert (listed[1] != alone[0]).mean() > 0.5


def test_presence_and_frequency_penalties_count_generated_tokens_only(llama):
    """OpenAI's penalties (as vLLM applies them) against a host-side greedy reference over the
    model's own logits: logit - frequency * count - presence * (count > 0), counted over the
    tokens generated, not the prompt's; stream gives the same tokens."""
    params, new = llama.params, 20
    start = random_tokens((1, 4), seed=3)
    # A prompt holding the tokens greedy decoding picks next: counting it would change the tokens
    prompt = np.concatenate([start, jaxllm.generate(params, start, max_new_tokens=8).tokens], axis=1)
    presence, frequency = 0.8, 0.6
    out = jaxllm.generate(params, prompt, max_new_tokens=new, eos_token_ids=[], presence_penalty=presence,
                          frequency_penalty=frequency)

    def reference(count_prompt: bool):
        cache = jaxllm.init_cache(params.config, 1, 12 + new, params.dtype)
        logits, cache = jaxllm.prefill(params, prompt, cache)
        counts = np.zeros(params.config.vocab_size, np.float32)
        if count_prompt:
            np.add.at(counts, prompt[0], 1)
        tokens = []
        for _ in range(new):
            x = np.asarray(logits[0], np.float32) - np.float32(frequency) * counts
            x = x - np.float32(presence) * (counts > 0)
            tokens.append(int(np.argmax(x)))
            counts[tokens[-1]] += 1
            logits, cache = jaxllm.decode_step(params, jnp.asarray(tokens[-1:], jnp.int32), cache)
        return tokens
    want = reference(count_prompt=False)
    assert want != reference(count_prompt=True)  # the test tells the two apart
    assert out.tokens[0].tolist() == want
    free = jaxllm.generate(params, prompt, max_new_tokens=new, eos_token_ids=[]).tokens
    assert _repeats(out.tokens) < _repeats(free)
    assert list(jaxllm.stream(params, prompt[0].tolist(), max_new_tokens=new, eos_token_ids=[],
                              presence_penalty=presence, frequency_penalty=frequency)) == want


def test_the_greedy_loop_neither_sorts_nor_draws(llama):
    """Which filters run is static: an all-greedy batch (whatever its rows' unused filter
    settings) compiles no sort and no random bits, a sampled row brings both."""
    from jaxllm.engine.sampling import SamplingConfig
    gen = importlib.import_module("jaxllm.engine.generate")

    def program(**settings):
        s = SamplingConfig(**settings).validate(rows=2)
        return _generate_core.lower(
            llama.params, jnp.zeros((2, 16), jnp.int32), jnp.zeros((2,), jnp.int32), jnp.int32(8),
            gen._stop_array([2]), s.values(2), cache_length=32, steps=16, flags=s.static()).as_text()
    greedy = program(temperature=[0.0, 0.0], top_k=[5, 0], top_p=0.5, seed=[1, 2])
    assert "stablehlo.sort" not in greedy and "threefry" not in greedy
    sampled = program(temperature=[0.0, 0.5], top_k=[0, 5])
    assert "stablehlo.sort" in sampled and "threefry" in sampled
