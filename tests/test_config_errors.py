"""A malformed or meaningless config (config.json, generation_config.json, the safetensors index,
GGUF metadata, a converted checkpoint's jaxllm_config.json and params/) is a ValueError naming the
file and the key: never NaN logits, a later IndexError or a raw KeyError/TypeError."""

from __future__ import annotations

import json
import math
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxllm
from jaxllm.families import config_from_hf
from jaxllm.io import checkpoint, hf
from jaxllm.io.gguf import gguf_to_hf_config
from jaxllm.tools.presets import PRESETS, random_params
from hangs import error_within

NAN = float("nan")


@pytest.fixture
def hf_dir(llama, tmp_path):
    """A writable copy of the tiny llama checkpoint: (directory, its config.json as a dict)."""
    shutil.copytree(llama.path, tmp_path, dirs_exist_ok=True)
    return tmp_path, json.loads((tmp_path / "config.json").read_text())


def _write(path, value):
    path.write_text(json.dumps(value))


def _moe(c):  # the llama config as a Qwen3-MoE one
    return c | dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def _swa(c):  # the llama config as a Qwen2 one with sliding windows
    return c | dict(model_type="qwen2", use_sliding_window=True, sliding_window=4)


def _rope(c, **params):
    return c | dict(rope_parameters=c["rope_parameters"] | params)


# (name, edit of the config dict, what the message must say besides config.json's path)
BAD_CONFIGS = [
    ("eps_negative", lambda c: c | dict(rms_norm_eps=-1), r"rms_norm_eps must be a finite number >= 0.*-1"),
    ("eps_nan", lambda c: c | dict(rms_norm_eps=NAN), r"rms_norm_eps .*nan"),
    ("theta_zero", lambda c: _rope(c, rope_theta=0), r"rope_theta must be a finite number > 0.*0"),
    ("theta_negative", lambda c: _rope(c, rope_theta=-1), r"rope_theta .*-1"),
    ("theta_nan", lambda c: _rope(c, rope_theta=NAN), r"rope_theta .*nan"),
    ("old_theta_nan", lambda c: {k: v for k, v in c.items() if k != "rope_parameters"} | dict(rope_theta=NAN),
     r"rope_theta .*nan"),
    ("rope_type_unknown", lambda c: _rope(c, rope_type="ntk"), r"unsupported rope type 'ntk'"),
    ("factor_nan", lambda c: _rope(c, rope_type="linear", factor=NAN), r"factor .*nan"),
    ("factor_zero", lambda c: _rope(c, rope_type="linear", factor=0), r"factor must be a finite number > 0"),
    ("factor_negative", lambda c: _rope(c, rope_type="linear", factor=-2.0), r"factor .*-2"),
    ("llama3_equal_freq_factors", lambda c: _rope(c, rope_type="llama3", factor=8.0, low_freq_factor=2.0,
                                                  high_freq_factor=2.0, original_max_position_embeddings=32),
     r"high_freq_factor > low_freq_factor"),
    ("window_zero", lambda c: c | dict(sliding_window=0), r"sliding_window must be >= 1, got 0"),
    ("window_negative", lambda c: c | dict(sliding_window=-3), r"sliding_window must be >= 1, got -3"),
    ("window_text", lambda c: c | dict(sliding_window="abc"), r"sliding_window must be an integer, got 'abc'"),
    ("partial_zero", lambda c: c | dict(partial_rotary_factor=0), r"partial_rotary_factor .*> 0"),
    ("partial_two", lambda c: c | dict(partial_rotary_factor=2), r"partial_rotary_factor .*<= 1.*2"),
    ("layer_types_text", lambda c: _swa(c) | dict(layer_types="sliding_attention"), r"layer_types must list"),
    ("layer_types_short", lambda c: _swa(c) | dict(layer_types=["sliding_attention"]), r"layer_types .*3 layers"),
    ("no_vocab_size", lambda c: {k: v for k, v in c.items() if k != "vocab_size"},
     r"lacks required key 'vocab_size'"),
    ("vocab_size_text", lambda c: c | dict(vocab_size="abc"), r"vocab_size must be an integer, got 'abc'"),
    ("layers_text", lambda c: c | dict(num_hidden_layers="abc"), r"num_hidden_layers must be an integer"),
    ("layers_fraction", lambda c: c | dict(num_hidden_layers=2.5), r"num_hidden_layers must be an integer.*2\.5"),
    ("layers_bool", lambda c: c | dict(num_hidden_layers=True), r"num_hidden_layers must be an integer.*True"),
    ("zero_heads", lambda c: c | dict(num_attention_heads=0), r"num_attention_heads must be >= 1, got 0"),
    ("zero_kv_heads", lambda c: c | dict(num_key_value_heads=0), r"num_key_value_heads must be >= 1"),
    ("sparse_step_zero", lambda c: _moe(c) | dict(decoder_sparse_step=0), r"decoder_sparse_step must be >= 1"),
    ("mlp_only_layers_int", lambda c: _moe(c) | dict(mlp_only_layers=5), r"mlp_only_layers must be a list"),
    ("eos_dict", lambda c: c | dict(eos_token_id={}), r"eos_token_id must be an integer, got \{\}"),
    ("pad_text", lambda c: c | dict(pad_token_id="x"), r"pad_token_id must be an integer, got 'x'"),
    ("rope_parameters_list", lambda c: c | dict(rope_parameters=[1]), r"rope_parameters.* must be an object"),
    # counts and ids past what jaxllm can hold: refused before a flag is made per layer or expert
    # (a billion layers of Mixtral took all the memory) or an id wraps around in int32
    ("layers_billion", lambda c: c | dict(model_type="mixtral", num_hidden_layers=10**9),
     r"num_hidden_layers must be at most 4096, got 1000000000"),
    ("experts_huge", lambda c: c | dict(model_type="mixtral", num_local_experts=10**8),
     r"num_local_experts must be at most 4096, got 100000000"),
    ("qwen_experts_huge", lambda c: _moe(c) | dict(num_experts=2**31), r"num_experts must be at most 4096"),
    ("eos_past_int32", lambda c: c | dict(eos_token_id=2**70), r"eos_token_id must be at most 2147483647"),
    ("pad_past_int32", lambda c: c | dict(pad_token_id=2**40), r"pad_token_id must be at most 2147483647"),
    ("window_past_int32", lambda c: c | dict(sliding_window=10**12), r"sliding_window must be at most 2147483647"),
    # each value fine alone, but the frequencies or scale they make overflow float32: NaN logits before
    ("theta_tiny", lambda c: _rope(c, rope_theta=1e-50), r"rope_theta 1e-50.* float32 cannot hold"),
    ("linear_factor_tiny", lambda c: _rope(c, rope_type="linear", factor=1e-50), r"factor 1e-50.* float32 cannot"),
    ("yarn_attention_factor_huge", lambda c: _rope(c, rope_type="yarn", factor=2.0, attention_factor=1e39),
     r"yarn rope .* float32 cannot hold"),
    ("yarn_beta_fast_tiny", lambda c: _rope(c, rope_type="yarn", factor=2.0, beta_fast=1e-320),
     r"float32 cannot hold \(OverflowError"),  # was a raw OverflowError
    ("yarn_mscale_zero_division", lambda c: _rope(c, rope_type="yarn", factor=math.e, mscale=1, mscale_all_dim=-10),
     r"float32 cannot hold \(ZeroDivisionError"),  # was a raw ZeroDivisionError
    ("eps_huge", lambda c: c | dict(rms_norm_eps=1e300), r"rms_norm_eps must be a finite number .*<= 3\.40"),
]


@pytest.mark.parametrize("edit, message", [b[1:] for b in BAD_CONFIGS], ids=[b[0] for b in BAD_CONFIGS])
def test_bad_config_value_is_named(hf_dir, edit, message):
    path, config = hf_dir
    _write(path / "config.json", edit(config))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path / 'config.json'))}: .*{message}"):
        config_from_hf(path)


def test_more_layers_than_the_checkpoint_holds_is_named_at_once(hf_dir):
    """A config claiming far more layers than the checkpoint holds fails before a name is made for
    each (within the 4096 cap: 4000 layers' names are quick, but so is the message)."""
    path, config = hf_dir
    _write(path / "config.json", config | dict(num_hidden_layers=4000))
    error = error_within(60, lambda: jaxllm.load(path, dtype="float32"), ValueError)
    assert "the config has 4000 layers, but the checkpoint holds tensors of 3 layers only" in str(error)


def test_nan_eps_fails_the_load_not_the_logits(hf_dir):
    path, config = hf_dir
    _write(path / "config.json", config | dict(rms_norm_eps=NAN))
    with pytest.raises(ValueError, match=r"config\.json: rms_norm_eps"):
        jaxllm.load(path, dtype="float32")


def test_whole_float_counts_are_read_as_ints(hf_dir):
    path, config = hf_dir
    _write(path / "config.json", config | dict(num_hidden_layers=3.0, vocab_size=256.0))
    cfg = config_from_hf(path)
    assert (cfg.num_layers, cfg.vocab_size) == (3, 256) and isinstance(cfg.num_layers, int)


@pytest.mark.parametrize("content, message", [
    (b"[1, 2]", r"top level is list"),
    (b"null", r"top level is NoneType"),
    (b'{"model_type": "llama"\xff}', r"is not valid JSON: not UTF-8"),
    (b'{"model_type": ', r"is not valid JSON"),
])
def test_malformed_config_file_is_named(hf_dir, content, message):
    path, _ = hf_dir
    (path / "config.json").write_bytes(content)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path / 'config.json'))}.*{message}"):
        config_from_hf(path)


@pytest.mark.parametrize("content, message", [
    ([2], r"top level is list"),
    ({"eos_token_id": "abc"}, r"eos_token_id: .*must be an integer, got 'abc'"),
    ({"eos_token_id": {"a": 1}}, r"eos_token_id: .*must be an integer"),
    ({"eos_token_id": 2.9}, r"eos_token_id: .*must be an integer, got 2\.9"),
    ({"eos_token_id": [2, None]}, r"eos_token_id: .*must be an integer, got None"),
])
def test_malformed_generation_config_is_named(hf_dir, content, message):
    path, _ = hf_dir
    _write(path / "generation_config.json", content)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path / 'generation_config.json'))}.*{message}"):
        hf.read_config(path)


@pytest.mark.parametrize("index", [
    {"weight_map": ["model.safetensors"]},
    {"weight_map": None},
    {"weight_map": {"model.norm.weight": 3}},
    {"metadata": {}},
    ["weight_map"],
    None,
])
def test_malformed_index_is_named(hf_dir, index):
    path, _ = hf_dir
    _write(path / "model.safetensors.index.json", index)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path / 'model.safetensors.index.json'))} is malformed"):
        hf.safetensor_files(path)


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_weights_that_are_not_a_regular_file_are_refused_unopened(hf_dir, kind):
    path, _ = hf_dir
    weights = path / "model.safetensors"
    weights.unlink()
    weights.mkdir() if kind == "directory" else os.mkfifo(weights)
    # a FIFO opened for reading blocks until a writer comes
    error = error_within(30, lambda: hf.read_checkpoint(path))
    assert f"{weights} is not a regular file" in str(error)


# --- GGUF metadata ------------------------------------------------------------------------------


def _tiny_gguf(tmp_path, monkeypatch, **metadata):
    """test_gguf's tiny llama GGUF, with writer calls overridden: {method name: its value}."""
    import gguf
    from test_gguf import write_tiny
    for name, value in metadata.items():
        original = getattr(gguf.GGUFWriter, name)
        monkeypatch.setattr(gguf.GGUFWriter, name, lambda self, _, o=original, v=value: o(self, v))
    path = tmp_path / "tiny.gguf"
    write_tiny(path, "llama")
    return path


@pytest.mark.parametrize("method, value, key", [
    ("add_rope_freq_base", 0.0, "llama.rope.freq_base = 0.0"),
    ("add_rope_freq_base", -1.0, "llama.rope.freq_base = -1.0"),
    ("add_rope_freq_base", NAN, "llama.rope.freq_base = nan"),
    ("add_layer_norm_rms_eps", NAN, "llama.attention.layer_norm_rms_epsilon = nan"),
    ("add_layer_norm_rms_eps", -1.0, "llama.attention.layer_norm_rms_epsilon = -1.0"),
])
def test_bad_gguf_metadata_is_named(tmp_path, monkeypatch, method, value, key):
    path = _tiny_gguf(tmp_path, monkeypatch, **{method: value})
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: GGUF metadata {re.escape(key)}"):
        gguf_to_hf_config(path)


@pytest.mark.parametrize("factor", [NAN, 0.0, -2.0])
def test_bad_gguf_rope_scaling_factor_is_named(tmp_path, monkeypatch, factor):
    import gguf
    add_base = gguf.GGUFWriter.add_rope_freq_base

    def add_scaling(self, base):
        add_base(self, base)
        self.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        self.add_rope_scaling_factor(factor)
    monkeypatch.setattr(gguf.GGUFWriter, "add_rope_freq_base", add_scaling)
    path = _tiny_gguf(tmp_path, monkeypatch)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: GGUF metadata llama\.rope\.scaling\.factor = {factor}"):
        gguf_to_hf_config(path)


# --- converted (orbax) checkpoints --------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A converted checkpoint of the tiny preset (random weights)."""
    return checkpoint.save(random_params(PRESETS["tiny"], 0, jnp.float32),
                           tmp_path_factory.mktemp("converted") / "ckpt")


@pytest.fixture
def converted(saved, tmp_path):
    """A writable copy of it: (directory, its jaxllm_config.json as a dict)."""
    directory = tmp_path / "ckpt"
    shutil.copytree(saved, directory)
    return directory, json.loads((directory / checkpoint.CONFIG_FILE).read_text())


@pytest.mark.slow
def test_converted_copy_loads(converted, monkeypatch):
    """A copy loads in its own dtype, and cast: read as float32 and checked a part at a time, so
    that the float32 model is never whole on the device beside its bfloat16 copy."""
    directory, _ = converted
    assert jaxllm.load(directory, dtype="float32").config == PRESETS["tiny"]
    saved = jax.tree.leaves(random_params(PRESETS["tiny"], 0, jnp.float32))
    reads, restore_part = [], checkpoint._restore_part
    monkeypatch.setattr(checkpoint, "_restore_part", lambda directory, arrays, whole: reads.append(
        sum(int(np.prod(s.shape)) * s.dtype.itemsize for s in arrays.values())) or restore_part(directory, arrays, whole))
    for a, b in zip(jax.tree.leaves(jaxllm.load(directory, dtype="bfloat16")), saved, strict=True):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(jnp.bfloat16)))
    total = sum(x.nbytes for x in saved)
    assert sum(reads) == total and max(reads) <= total / 4, (reads, total)


def _config(meta, **changes):
    return meta | {"config": meta["config"] | changes}


BAD_CHECKPOINT_CONFIGS = [
    ("not_json", b"{{{", r"is not valid JSON"),
    ("list", [1], r"top level is list"),
    ("no_config", lambda m: {k: v for k, v in m.items() if k != "config"}, r"config must be an object, not None"),
    ("missing_key", lambda m: m | {"config": {k: v for k, v in m["config"].items() if k != "head_dim"}},
     r"lacks keys \['head_dim'\]"),
    ("extra_key", lambda m: _config(m, heads=3), r"unknown keys \['heads'\]"),
    ("zero_kv_heads", lambda m: _config(m, num_kv_heads=0), r"num_kv_heads must be >= 1, got 0"),
    ("sliding_layers_null", lambda m: _config(m, sliding_layers=None), r"sliding_layers must be"),
    ("eps_nan", lambda m: _config(m, rms_norm_eps=NAN), r"rms_norm_eps .*nan"),
    ("theta_zero", lambda m: _config(m, rope=m["config"]["rope"] | {"theta": 0}), r"rope_theta .*> 0"),
    ("unknown_model_type", lambda m: _config(m, model_type="gpt2"), r"unknown architecture: model_type 'gpt2'"),
    ("bad_quant", lambda m: m | {"quant": "int4"}, r"quant 'int4'"),
    ("format_1", lambda m: m | {"format": 1}, r"checkpoint format 1 is not 2: convert it again"),
    ("no_digests", lambda m: {k: v for k, v in m.items() if k != "digests"}, r"digests must map each array"),
    ("digest_not_hex", lambda m: m | {"digests": m["digests"] | {"embed": "0x12"}}, r"digests must map each array"),
    ("digest_missing", lambda m: m | {"digests": {k: v for k, v in m["digests"].items() if k != "embed"}},
     r"no digests for \['embed'\]"),
    ("digest_unknown", lambda m: m | {"digests": m["digests"] | {"layers.9.wo": "0" * 8}},
     r"digests for arrays the model does not have \['layers.9.wo'\]"),
]


@pytest.mark.parametrize("edit, message", [b[1:] for b in BAD_CHECKPOINT_CONFIGS],
                         ids=[b[0] for b in BAD_CHECKPOINT_CONFIGS])
def test_bad_converted_config_is_named(converted, edit, message):
    directory, meta = converted
    path = directory / checkpoint.CONFIG_FILE
    path.write_bytes(edit if isinstance(edit, bytes) else json.dumps(edit(meta) if callable(edit) else edit).encode())
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}.*{message}"):
        jaxllm.load(directory, dtype="float32")


def _truncate_data(params):
    for f in (params / "ocdbt.process_0" / "d").iterdir():
        os.truncate(f, f.stat().st_size // 2)


@pytest.mark.parametrize("damage, message", [
    (lambda p: shutil.rmtree(p), r"has no params/ directory"),
    (lambda p: (p / "_METADATA").write_text("garbage"), r"params/ lists no arrays"),
    (lambda p: (p / "manifest.ocdbt").write_bytes(b"\0" * 64), r"params/ lists no arrays"),
    (_truncate_data, r"cannot read the converted checkpoint's params/"),
])
def test_damaged_converted_params_are_named(converted, damage, message):
    directory, _ = converted
    damage(directory / "params")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(directory))}: .*{message}"):
        jaxllm.load(directory, dtype="float32")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8"])
@pytest.mark.parametrize("shape", [(), (7,), (5, 9), (2, 3, 4, 5)])
def test_digest_changes_with_any_one_bit_or_swap(dtype, shape):
    """Every copy of an array with one bit flipped, anywhere, or two unequal elements swapped, has
    another digest than the array (a plain sum would miss the swaps)."""
    x = np.asarray(jnp.asarray(np.random.default_rng(0).standard_normal(shape) * 50).astype(dtype)).reshape(-1)
    bits = x.view(f"u{x.itemsize}")
    flips = np.repeat(bits[None], bits.size * 8 * x.itemsize, axis=0)
    rows = np.arange(len(flips))
    flips[rows, rows // (8 * x.itemsize)] ^= (1 << (rows % (8 * x.itemsize))).astype(bits.dtype)
    pairs = [(i, j) for i in range(x.size) for j in range(i) if bits[i] != bits[j]]
    swaps = np.repeat(bits[None], len(pairs), axis=0)
    for row, (i, j) in enumerate(pairs):
        swaps[row, [i, j]] = bits[[j, i]]
    copies = jnp.asarray(np.concatenate([flips, swaps]).view(x.dtype).reshape(-1, *shape))
    assert not np.any(np.asarray(jax.vmap(checkpoint.digest)(copies)) == int(checkpoint.digest(x.reshape(shape))))


def test_a_restore_into_a_dtype_too_narrow_is_named(tmp_path):
    """A float32 checkpoint holding 1e6 restored as float16 gave infinity there and NaN logits;
    the cast is checked, as a direct load checks it (bfloat16 holds it)."""
    params = random_params(PRESETS["tiny"], 0, jnp.float32)
    layers = list(params.layers)
    layers[0] = layers[0].replace(w_down=layers[0].w_down.at[0, 0].set(1e6))
    directory = checkpoint.save(params.replace(layers=layers), tmp_path / "big")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(directory))}: layers\.0\.w_down hold values past "
                                         r"what float16 can hold"):
        jaxllm.load(directory, dtype="float16")
    assert float(jaxllm.load(directory, dtype="bfloat16").layers[0].w_down[0, 0]) == 999424.0  # 1e6, rounded


def test_params_of_another_save_are_named(converted, tmp_path):
    """params/ holding other values than its digests say (here: one weight changed, written by a
    second save) is refused, naming that weight, in the saved dtype and when cast on restore."""
    directory, _ = converted
    params = random_params(PRESETS["tiny"], 0, jnp.float32)
    layers = list(params.layers)
    layers[1] = layers[1].replace(w_down=layers[1].w_down.at[3, 5].add(1e-6))
    other = checkpoint.save(params.replace(layers=layers), tmp_path / "other")
    shutil.rmtree(directory / "params")
    shutil.copytree(other / "params", directory / "params")
    for dtype in ("float32", "bfloat16"):
        with pytest.raises(ValueError, match=rf"^{re.escape(str(directory))}: the converted checkpoint's "
                                             r"params/ is damaged: layers\.1\.w_down read back other bits"):
            jaxllm.load(directory, dtype=dtype)


def test_changed_data_bytes_are_named_or_harmless(saved, tmp_path):
    """Bytes overwritten inside params/' largest data file: each load is refused with the
    checkpoint named, or gives the saved weights exactly, never other weights. Before the digests,
    most such loads gave other weights without a word (zstd notices few such changes)."""
    expected = [np.asarray(x) for x in jax.tree.leaves(random_params(PRESETS["tiny"], 0, jnp.float32))]
    rng = np.random.default_rng(0)
    by_digest = 0
    for i in range(12):
        directory = shutil.copytree(saved, tmp_path / str(i))
        data = max((directory / "params" / "ocdbt.process_0" / "d").iterdir(), key=lambda f: f.stat().st_size)
        with open(data, "r+b") as f:
            f.seek(int(rng.integers(0, data.stat().st_size - 16)))
            f.write(rng.integers(0, 256, 16, dtype=np.uint8).tobytes())
        try:
            loaded = jax.tree.leaves(jaxllm.load(directory, dtype="float32"))
        except ValueError as e:
            assert str(e).startswith(f"{directory}: "), e
            by_digest += "digests differ" in str(e)
            continue
        for a, b in zip(loaded, expected, strict=True):
            np.testing.assert_array_equal(np.asarray(a), b)
    assert by_digest > 0  # the digests, not only orbax's own checks, did the refusing
