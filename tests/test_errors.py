"""Bad input gets a ValueError that names the problem: never a wrap-around, NaN, hang or unpickle."""

import dataclasses
import json
import pickle
import re
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jaxllm
from tiny_models import MAX_POS, VOCAB, random_tokens

PROMPT = [[5, 6, 7]]


@pytest.mark.parametrize("ids, message", [
    ([[5, -1, 7]], r"token id -1 out of range"),
    ([[5, VOCAB, 7]], rf"token id {VOCAB} out of range.*{VOCAB} ids"),
    ([[5, 6], [VOCAB + 3]], rf"token id {VOCAB + 3} out of range"),
    (np.array([[5, -1]], np.int32), r"token id -1 out of range"),
    ([[]], r"prompt 0 is empty"),
    ([[5, 6], []], r"prompt 1 is empty"),
    (np.zeros((1, 0), np.int32), r"prompt 0 is empty"),
    ([], r"batch of 0"),
    (np.zeros((0, 4), np.int32), r"batch of 0"),
    (np.array([5, 6, 7]), r"\[B, T\] array"),
    ([[[5, 6], [7, 8]]], r"prompt 0 must be a list of token ids, got shape \(2, 2\)"),  # not flattened
    ([[5, 6], 7], r"prompt 1 must be a list of token ids, got int"),
    ([[5.9, 6.9]], r"token ids must be integers, got dtype float64"),  # not truncated to 5, 6
    ([[True, False]], r"token ids must be integers, got dtype bool"),
    ([[5, 2 ** 64]], rf"token id {2 ** 64} out of range"),  # not wrapped
])
def test_bad_prompts(llama, ids, message):
    with pytest.raises(ValueError, match=message):
        jaxllm.generate(llama.params, ids, max_new_tokens=4)


def test_prompt_plus_new_tokens_over_the_context(llama):
    prompt = random_tokens((1, MAX_POS - 10)).tolist()
    message = rf"{MAX_POS - 10} tokens plus max_new_tokens=11 .*context of {MAX_POS}"
    with pytest.raises(ValueError, match=message):
        jaxllm.generate(llama.params, prompt, max_new_tokens=11)
    with pytest.raises(ValueError, match=rf"context of {MAX_POS}"):
        jaxllm.forward(llama.params, random_tokens((1, MAX_POS + 1)))


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.5), r"temperature must be >= 0.*-0.5"),
    (dict(temperature=float("nan")), r"temperature must be >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\].*0.0"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\].*1.5"),
    (dict(top_k=-1), r"top_k must be .*>= 0.*-1"),
    (dict(top_k=2.5), r"top_k must be an integer, got 2.5"),
    (dict(min_p=1.5), r"min_p must be in \[0, 1\].*1.5"),
    (dict(min_p=-0.1), r"min_p must be in \[0, 1\]"),
    (dict(repetition_penalty=0.0), r"repetition_penalty must be > 0.*0.0"),
    (dict(repetition_penalty=-1.0), r"repetition_penalty must be > 0"),
    (dict(max_new_tokens=0), r"max_new_tokens must be .*>= 1.*0"),
    (dict(max_new_tokens=float("nan")), r"max_new_tokens must be an integer"),
    (dict(max_new_tokens=None), r"max_new_tokens must be an integer, got None"),
    (dict(max_new_tokens="4"), r"max_new_tokens must be an integer, got '4'"),
    (dict(temperature=float("inf")), r"temperature must be >= 0 .*finite"),
    (dict(temperature=None), r"temperature must be a number, got None"),
    (dict(top_p="x"), r"top_p must be a number"),
    (dict(temperature=1.0, top_k=2 ** 31), r"top_k must be .*at most 2147483647"),
    (dict(temperature=1.0, top_k=float("inf")), r"top_k must be an integer"),
    (dict(seed=2 ** 63), r"seed must be at most 9223372036854775807"),
    (dict(seed=1.5), r"seed must be an integer"),
    (dict(eos_token_ids=[2 ** 40]), r"stop id \(eos_token_ids\) must be at most"),
    (dict(eos_token_ids=5), r"eos_token_ids must be a list of token ids or None, got 5"),
])
def test_bad_sampling_settings(llama, kwargs, message):
    kwargs = dict(max_new_tokens=4) | kwargs
    with pytest.raises(ValueError, match=message):
        jaxllm.generate(llama.params, PROMPT, **kwargs)
    with pytest.raises(ValueError, match=message):
        next(jaxllm.stream(llama.params, PROMPT[0], **kwargs))


@pytest.mark.slow
def test_whole_numbers_given_as_floats_are_taken(llama):
    want = jaxllm.generate(llama.params, PROMPT, max_new_tokens=4, seed=3).tokens
    got = jaxllm.generate(llama.params, PROMPT, max_new_tokens=4.0, seed=np.int64(3), eos_token_ids=np.array([2]))
    np.testing.assert_array_equal(got.tokens, want)
    assert list(jaxllm.stream(llama.params, PROMPT[0], max_new_tokens=4.0)) == np.asarray(want)[0].tolist()


def test_perplexity_refuses_ids_it_would_wrap_or_flatten(llama):
    from jaxllm.engine.score import perplexity
    with pytest.raises(ValueError, match=rf"token id {2 ** 32 + 7} out of range"):
        perplexity(llama.params, np.array([5, 6, 2 ** 32 + 7, 8, 9, 10]), context=4)
    with pytest.raises(ValueError, match=r"got shape \(2, 3\)"):
        perplexity(llama.params, [[5, 6, 7], [8, 9, 10]], context=4)
    with pytest.raises(ValueError, match=r"must be integers"):
        perplexity(llama.params, [5.5, 6.5, 7.5], context=4)
    with pytest.raises(ValueError, match=r"the text has 0 token\(s\)"):  # not "got dtype float64"
        perplexity(llama.params, [], context=4)


@pytest.mark.parametrize("tokens, message", [
    ([[5, 6], [7]], r"rows differ in length or hold nested lists"),  # was numpy's "inhomogeneous shape"
    ([[5, [6]]], r"rows differ in length or hold nested lists"),
    ([[]], r"non-empty \[B, T\] array, got shape \(1, 0\)"),  # was "got dtype float64"
    ([[True, 5]], r"got a bool among them"),  # True was token 1
])
def test_forward_names_tokens_it_cannot_take(llama, tokens, message):
    with pytest.raises(ValueError, match=message):
        jaxllm.forward(llama.params, tokens)


def test_cli_perplexity_names_a_file_that_is_not_utf8(tmp_path, capsys):
    from jaxllm import cli
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\xe9 au lait".encode("latin-1"))
    assert cli.main(["perplexity", str(path)]) == 2
    assert f"{path} is not UTF-8 text (invalid continuation byte at byte 3)" in capsys.readouterr().err


@pytest.mark.parametrize("dtype, message", [
    ("int8", r"dtype must be a floating type .*got int8"),  # the weights' dtype; int8 is quant="int8"
    ("bool", r"dtype must be a floating type"),
    ("floatx", r"unknown dtype 'floatx'"),
    ("float64", r"dtype float64 is not one jaxllm runs a model in"),  # silently float32 without x64
    ("float8_e4m3fn", r"dtype float8_e4m3fn is not one jaxllm runs a model in.*quant='int8'"),  # ran, other tokens
])
def test_load_refuses_a_dtype_the_model_cannot_run_in(llama, dtype, message):
    with pytest.raises(ValueError, match=message):
        jaxllm.load(llama.path, dtype=dtype)


def test_arguments_of_the_wrong_kind_are_named(llama):
    """Not AttributeErrors from deep inside: a path that is not one, a mesh that is not a Mesh, a
    path where the params go."""
    with pytest.raises(TypeError, match=r"path must be a str or os.PathLike .*got int 5"):
        jaxllm.load(5)
    with pytest.raises(TypeError, match=r"path must be a str or os.PathLike .*got bytes"):
        jaxllm.load(str(llama.path).encode())
    with pytest.raises(TypeError, match=r"mesh must be a jax.sharding.Mesh .*got str 'tp'"):
        jaxllm.load(llama.path, dtype="float32", mesh="tp")
    for call in (lambda: jaxllm.generate(str(llama.path), [[5, 6]]), lambda: next(jaxllm.stream(llama.path, [5, 6])),
                 lambda: jaxllm.forward(str(llama.path), [[5, 6]])):
        with pytest.raises(TypeError, match=r"params must be a model's Params, as jaxllm.load returns them, got"):
            call()


@pytest.mark.slow
@pytest.mark.parametrize("name, value, message", [
    ("JAXLLM_LOAD_THREADS", "abc", "JAXLLM_LOAD_THREADS='abc' is not an integer"),
    ("JAXLLM_DECODE_TILES", "64,128", "JAXLLM_DECODE_TILES='64,128' is not a comma-separated list of 3 integers"),
])
def test_a_tuning_variable_that_does_not_parse_is_named(name, value, message):
    import os
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", "import jaxllm"], env=dict(os.environ, **{name: value}),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and message in r.stderr.splitlines()[-1], r.stderr[-2000:]


def test_low_level_calls_check_the_cache_and_the_context(llama):
    params, cfg = llama.params, llama.params.config
    for kwargs, message in [(dict(batch=-1, length=8), r"cache batch must be >= 1, got -1"),
                            (dict(batch=1, length=2.5), r"cache length must be an integer, got 2.5"),
                            (dict(batch=1, length=8, dtype="int32"), r"cache dtype must be a floating type"),
                            (dict(batch=2, length=8, start=[0]), r"start must be 2 whole numbers in \[0, 8\)"),
                            (dict(batch=2, length=8, start=[0, -1]), r"start must be 2 whole numbers"),
                            # an int32 slot count, not XLA's RESOURCE_EXHAUSTED for a 10**12-slot cache
                            (dict(batch=1, length=10**12),
                             r"cache length must be at most 2147483647, got 1000000000000")]:
        with pytest.raises(ValueError, match=message):
            jaxllm.init_cache(cfg, **kwargs)
    with pytest.raises(TypeError, match=r"init_cache takes the model's ModelConfig \(params.config\), got Params"):
        jaxllm.init_cache(params, 1, 8)  # was an AttributeError: 'Params' object has no attribute 'num_layers'
    # A cache made for another model (here: one layer fewer) is named, not an IndexError in the step
    other = jaxllm.init_cache(dataclasses.replace(cfg, num_layers=cfg.num_layers - 1), 1, 8, params.dtype)
    message = rf"the cache was made for another model: {cfg.num_layers - 1} layers of"
    with pytest.raises(ValueError, match=message):
        jaxllm.prefill(params, random_tokens((1, 4)), other)
    with pytest.raises(ValueError, match=message):
        jaxllm.decode_step(params, [5], other)
    # A cache longer than the model's context may hold a prompt; positions past it are refused.
    cache = jaxllm.init_cache(cfg, 1, MAX_POS + 8, params.dtype)
    with pytest.raises(ValueError, match=rf"reaches position {MAX_POS + 3}, past the model's context of {MAX_POS}"):
        jaxllm.prefill(params, random_tokens((1, MAX_POS + 4)), cache)
    _, cache = jaxllm.prefill(params, random_tokens((1, MAX_POS)), cache)
    with pytest.raises(ValueError, match=rf"reaches position {MAX_POS}, past the model's context"):
        jaxllm.decode_step(params, [5], cache)


def test_low_level_calls_check_token_ids(llama):
    params = llama.params
    cache = jaxllm.init_cache(params.config, 1, 8, params.dtype)
    with pytest.raises(ValueError, match=rf"token id {VOCAB} out of range"):
        jaxllm.forward(params, [[1, VOCAB]])
    with pytest.raises(ValueError, match=r"token id -1 out of range"):
        jaxllm.prefill(params, [[1, -1]], cache)
    with pytest.raises(ValueError, match=rf"token id {VOCAB} out of range"):
        jaxllm.decode_step(params, [VOCAB], cache)
    with pytest.raises(ValueError, match=r"must be integers"):
        jaxllm.forward(params, [[1.0, 2.0]])


def test_writing_past_the_end_of_the_cache_is_an_error(llama):
    params = llama.params
    cache = jaxllm.init_cache(params.config, 1, 8, params.dtype)
    message = r"cache full: writing 9 token\(s\) at slot 0 needs 9 slots, the cache has 8"
    with pytest.raises(ValueError, match=message):
        jaxllm.prefill(params, random_tokens((1, 9)), cache)
    full = cache.replace(end=jnp.full((1,), 8, jnp.int32))  # as after 8 written tokens
    with pytest.raises(ValueError, match=r"cache full: writing 1 token\(s\) at slot 8"):
        jaxllm.decode_step(params, [5], full)
    with pytest.raises(ValueError, match=r"cache full"):
        jaxllm.prefill(params, random_tokens((1, 2)), cache.replace(end=jnp.full((1,), 7, jnp.int32)))


# ---------------------------------------------------------------------------------------------
# Checkpoints


@pytest.fixture
def checkpoint(llama, tmp_path):
    """A writable copy of the tiny llama checkpoint."""
    shutil.copytree(llama.path, tmp_path, dirs_exist_ok=True)
    return tmp_path


def _rewrite_tensors(directory, edit):
    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_checkpoint_copy_loads(checkpoint):
    assert jaxllm.load(checkpoint, dtype="float32").config.num_layers == 3  # the fixture is sound


def test_missing_tensor_is_named(checkpoint):
    _rewrite_tensors(checkpoint, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\): model\.layers\.1\.mlp\.down_proj\.weight"):
        jaxllm.load(checkpoint, dtype="float32")


def test_unexpected_tensor_is_named(checkpoint):
    def add(t):
        t["model.layers.0.self_attn.extra_proj.weight"] = np.zeros((4, 4), np.float32)
    _rewrite_tensors(checkpoint, add)
    message = r"unexpected tensor\(s\): model\.layers\.0\.self_attn\.extra_proj\.weight"
    with pytest.raises(ValueError, match=message):
        jaxllm.load(checkpoint, dtype="float32")


def test_wrong_shape_is_named(checkpoint):
    def shrink(t):
        t["model.layers.2.self_attn.k_proj.weight"] = t["model.layers.2.self_attn.k_proj.weight"][:16]
    _rewrite_tensors(checkpoint, shrink)
    message = r"model\.layers\.2\.self_attn\.k_proj\.weight has shape \(16, 64\), expected \(32, 64\)"
    with pytest.raises(ValueError, match=message):
        jaxllm.load(checkpoint, dtype="float32")


@pytest.mark.parametrize("keep", [0.6, 0.001])
def test_truncated_safetensors(checkpoint, keep):
    path = checkpoint / "model.safetensors"
    with open(path, "r+b") as f:
        f.truncate(int(path.stat().st_size * keep))
    with pytest.raises(ValueError, match=r"model\.safetensors is not a valid safetensors file"):
        jaxllm.load(checkpoint, dtype="float32")


class _Evil:
    """Unpickling this creates a marker file: proof that a loader ran pickle."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_pickle_checkpoint_is_refused_without_unpickling(checkpoint, tmp_path_factory):
    (checkpoint / "model.safetensors").unlink()
    marker = tmp_path_factory.mktemp("marker") / "unpickled"
    (checkpoint / "pytorch_model.bin").write_bytes(pickle.dumps({"model.embed_tokens.weight": _Evil(marker)}))
    with pytest.raises(ValueError, match=r"only pickle-based weights \(pytorch_model\.bin\).*safetensors"):
        jaxllm.load(checkpoint, dtype="float32")
    assert not marker.exists(), "jaxllm unpickled the checkpoint"
    # The payload is live: unpickling it does create the marker.
    pickle.loads((checkpoint / "pytorch_model.bin").read_bytes())["model.embed_tokens.weight"].close()
    assert marker.exists()


def test_unknown_model_type_is_named(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    config.update(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"])
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unknown architecture: model_type 'gpt_neox'.*GPTNeoXForCausalLM"):
        jaxllm.load(checkpoint, dtype="float32")


def test_missing_config_json(checkpoint):
    (checkpoint / "config.json").unlink()
    with pytest.raises(ValueError, match=r"config\.json not found"):
        jaxllm.load(checkpoint, dtype="float32")


def test_config_json_that_is_a_directory(checkpoint):
    (checkpoint / "config.json").unlink()
    (checkpoint / "config.json").mkdir()  # was reported as config.json/config.json not found
    with pytest.raises(ValueError, match=rf"^{re.escape(str(checkpoint / 'config.json'))} is not a regular file"):
        jaxllm.load(checkpoint, dtype="float32")


def test_malformed_config_json(checkpoint):
    (checkpoint / "config.json").write_text('{"model_type": "llama", "hidden_size": 64,')
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        jaxllm.load(checkpoint, dtype="float32")


def test_config_without_a_required_key(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    del config["num_hidden_layers"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"lacks required key 'num_hidden_layers'"):
        jaxllm.load(checkpoint, dtype="float32")


@pytest.mark.parametrize("value, dtype", [(np.nan, np.float32), (-np.inf, np.float32),
                                          (np.inf, "bfloat16"), (np.nan, np.float16)])
def test_a_weight_that_is_not_a_number_is_named(checkpoint, value, dtype):
    """A damaged checkpoint is refused where it is read, naming the tensor and the index, rather than
    giving NaN logits (here in a fused qkv part, so the index is the source tensor's own)."""
    import torch
    from safetensors.torch import load_file as load_torch, save_file as save_torch

    path = checkpoint / "model.safetensors"
    tensors = load_torch(path)
    for name, t in tensors.items():
        tensors[name] = t.to(getattr(torch, str(np.dtype(jnp.dtype(dtype)))))
    tensors["model.layers.1.self_attn.k_proj.weight"][5, 7] = value
    save_torch(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"tensor model\.layers\.1\.self_attn\.k_proj\.weight holds "
                                         r"-?(nan|inf) at index \(5, 7\): the checkpoint is damaged"):
        jaxllm.load(checkpoint, dtype="float32")


@pytest.mark.parametrize("value, source, dtype", [(1e6, np.float32, "float16"), (-70000.0, "bfloat16", "float16"),
                                                  (1e300, np.float64, "float32")])
def test_a_weight_too_large_for_the_dtype_is_named(checkpoint, value, source, dtype):
    """A finite weight past the range of the dtype asked for would load as infinity and give NaN
    logits: it is refused, naming the tensor, the index and the dtype; the source's own dtype loads."""
    from safetensors.numpy import load_file, save_file

    path = checkpoint / "model.safetensors"
    tensors = {name: t.astype(np.dtype(jnp.dtype(source))) for name, t in load_file(path).items()}
    tensors["model.layers.1.self_attn.k_proj.weight"][5, 7] = value
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"tensor model\.layers\.1\.self_attn\.k_proj\.weight holds "
                                         rf"{re.escape(f'{np.dtype(jnp.dtype(source)).type(value)}')} at index "
                                         rf"\(5, 7\), past what {dtype} can hold \(it would become -?inf\)"):
        jaxllm.load(checkpoint, dtype=dtype)
    wide = "float32" if source != np.float64 else None
    if wide:
        assert np.isfinite(np.asarray(jaxllm.load(checkpoint, dtype=wide).layers[1].wqkv, np.float32)).all()


def test_first_nonfinite_finds_values_too_large_for_the_target():
    from jaxllm.io.reading import first_nonfinite

    x = np.zeros((4, 5), np.float32)
    x[2, 3] = 65519.99  # rounds to float16's largest, 65504
    assert first_nonfinite(x, "float16") is None
    x[3, 1] = -65520.0  # rounds to -inf
    assert first_nonfinite(x, "float16") == (3, 1)
    assert first_nonfinite(x, "bfloat16") is None and first_nonfinite(x, "float32") is None
    x[0, 0] = 3.4e38  # past bfloat16's largest, 3.3895e38, by more than half a step
    assert first_nonfinite(x, "bfloat16") == (0, 0)


def test_first_nonfinite_finds_every_nan_and_infinity():
    from jaxllm.io.reading import first_nonfinite

    for dtype in (np.float16, jnp.bfloat16, np.float32, np.float64, jnp.float8_e4m3fn):
        x = np.linspace(-2, 2, 3 << 20).astype(dtype).reshape(3, -1)
        assert first_nonfinite(x) is None
        for value in (np.nan, np.inf, -np.inf):  # (float8_e4m3fn has no infinity: it stores NaN)
            y = x.copy()
            y[2, 12345] = value
            assert first_nonfinite(y) == (2, 12345), (dtype, value)
        # the largest finite value and the smallest subnormal are numbers
        y = x.copy()
        y[1, 3] = jnp.finfo(dtype).max
        y[1, 4] = jnp.finfo(dtype).smallest_subnormal
        assert first_nonfinite(y) is None
    assert first_nonfinite(np.arange(10)) is None
