"""GGUF loading against transformers (the oracle) and against the weights a file was written from.

transformers' `from_pretrained(..., gguf_file=...)` needs `accelerate`, which the project does not
install; for llama/qwen2/qwen3 it hands the file to `load_gguf_checkpoint`, which we call directly
with the same model skeleton, so the tensors compared are the ones `from_pretrained` would load.
"""

import json
import math
import pickle
import re
import struct

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from jaxllm.io import gguf as jaxllm_gguf
from jaxllm.io.gguf import read_gguf, read_gguf_header
from jaxllm.io.paths import default_model_path
from hangs import error_within

Q8_0 = gguf.GGMLQuantizationType.Q8_0


def transformers_gguf(path):
    """(config, {name: float32 array}) as transformers loads the GGUF file at `path`."""
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    # only the parameter names are needed to map GGUF names, so no weights are allocated
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    loaded = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model,
                                  torch_dtype=torch.float32)
    tensors = {k: v.numpy() for k, v in loaded["tensors"].items()}
    return config, tensors, set(model.state_dict())


@pytest.fixture(scope="module")
def default_ours():
    return read_gguf(default_model_path())


@pytest.fixture(scope="module")
def default_theirs():
    return transformers_gguf(default_model_path())


@pytest.mark.slow
def test_default_model_tensors_match_transformers(default_ours, default_theirs):
    _, ours = default_ours
    _, theirs, state_names = default_theirs
    # tied embeddings: transformers' state dict lists lm_head.weight as an alias; the file has none
    assert set(ours) == state_names - {"lm_head.weight"}
    assert set(ours) == set(theirs)
    for name, ref in theirs.items():
        assert ours[name].dtype == np.float32, name
        assert ours[name].shape == ref.shape, name
        np.testing.assert_allclose(ours[name], ref, rtol=0, atol=1e-6, err_msg=name)


@pytest.mark.slow
def test_default_model_config_matches_transformers(default_ours, default_theirs):
    config, _ = default_ours
    theirs, _, _ = default_theirs
    assert config["rope_theta"] == theirs.rope_parameters["rope_theta"]
    for key, value in config.items():
        if key in ("rope_theta", "architectures", "attention_bias", "hidden_act"):
            continue
        assert getattr(theirs, key) == value, key
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert not config["attention_bias"] and not theirs.attention_bias
    assert "rope_scaling" not in config
    # the shape DESIGN.md documents for the default model
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"], config["intermediate_size"],
            config["vocab_size"], config["tie_word_embeddings"]) == (30, 576, 9, 3, 64, 1536, 49152, True)


# --- tiny files written from known weights ---------------------------------------------------

_GGUF_LEAF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}


def llama_cpp_permute(w, n_heads):
    """convert_hf_to_gguf.py's LlamaModel.permute, written independently of jaxllm."""
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def hf_weights(D, N, K, H, F, L, V, bias, qk_norm, tied, experts=0, moe=None, seed=0):
    rng = np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not tied:
        shapes["lm_head.weight"] = (V, D)
    for i in range(L):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (N * H, D), p + "self_attn.k_proj.weight": (K * H, D),
                   p + "self_attn.v_proj.weight": (K * H, D), p + "self_attn.o_proj.weight": (D, N * H),
                   p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,)}
        if experts:
            router, gate, up, down = MOE_HF_NAMES[moe]
            shapes[p + router] = (experts, D)
            for e in range(experts):
                shapes |= {p + gate.format(e=e): (F, D), p + up.format(e=e): (F, D),
                           p + down.format(e=e): (D, F)}
        else:
            shapes |= {p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                       p + "mlp.down_proj.weight": (D, F)}
        if bias:
            shapes |= {p + "self_attn.q_proj.bias": (N * H,), p + "self_attn.k_proj.bias": (K * H,),
                       p + "self_attn.v_proj.bias": (K * H,)}
        if qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (H,), p + "self_attn.k_norm.weight": (H,)}
    return {name: rng.standard_normal(shape, dtype=np.float32) for name, shape in shapes.items()}


MOE_HF_NAMES = {
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.w1.weight",
                "block_sparse_moe.experts.{e}.w3.weight", "block_sparse_moe.experts.{e}.w2.weight"),
    "qwen3_moe": ("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
                  "mlp.experts.{e}.down_proj.weight"),
}


def gguf_name(hf_name):
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    parts = hf_name.split(".")
    return f"blk.{parts[2]}.{_GGUF_LEAF['.'.join(parts[3:-1])]}.{parts[-1]}"


def write_tiny(path, arch, *, D=256, N=2, K=1, H=128, F=96, L=2, V=64, bias=False, qk_norm=False,
               tied=True, quant=None, rope_freqs=None, rope_theta=10000.0, extra_tensors=(),
               experts=0, split_experts=False, drop=()):
    """Write a tiny GGUF the way llama.cpp's converter would; return the HF weights it holds.

    H is 128 because transformers' Qwen3 GGUF mapping ignores the head size and uses Qwen3's default.
    """
    moe = "mixtral" if arch == "llama" else "qwen3_moe"
    hf = hf_weights(D, N, K, H, F, L, V, bias, qk_norm, tied, experts, moe)
    w = gguf.GGUFWriter(path, arch)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(2)
        if arch == "qwen3moe":
            w.add_expert_feed_forward_length(F)
    w.add_name(f"tiny {arch}")
    w.add_block_count(L)
    w.add_context_length(256)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(N)
    w.add_head_count_kv(K)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(rope_theta)
    if arch == "llama":
        w.add_rope_dimension_count(H)
    else:
        w.add_key_length(H)
        w.add_value_length(H)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(["<|endoftext|>"] + [f"t{i}" for i in range(V - 1)])
    w.add_token_types([3] + [1] * (V - 1))
    w.add_token_merges([])
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    moe_leaves = dict(zip(MOE_HF_NAMES[moe], ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")))
    written = set()
    for i in range(L if experts else 0):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", hf[p + MOE_HF_NAMES[moe][0]])
        written.add(p + MOE_HF_NAMES[moe][0])
        for hf_name, leaf in list(moe_leaves.items())[1:]:
            names = [p + hf_name.format(e=e) for e in range(experts)]
            written.update(names)
            if split_experts:  # early Mixtral GGUFs: blk.{i}.ffn_gate.{e}.weight
                for e, name in enumerate(names):
                    w.add_tensor(f"blk.{i}.{leaf.removesuffix('_exps')}.{e}.weight", hf[name])
            else:  # stacked [E, out, in]
                w.add_tensor(f"blk.{i}.{leaf}.weight", np.stack([hf[name] for name in names]))
    for name, t in hf.items():
        g = gguf_name(name) if name not in written else None
        if g is None or g in drop:
            continue
        if arch == "llama" and ".attn_q." in g:
            t = llama_cpp_permute(t, N)
        elif arch == "llama" and ".attn_k." in g:
            t = llama_cpp_permute(t, K)
        if quant is not None and t.ndim == 2:
            w.add_tensor(g, gguf.quants.quantize(t, quant), raw_dtype=quant)
        else:
            w.add_tensor(g, t)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    for name, t in extra_tensors:
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


TINY = {
    "qwen3moe": ("qwen3moe", dict(qk_norm=True, experts=4)),
    "llama-untied": ("llama", dict(tied=False)),
    "llama-q8_0": ("llama", dict(quant=Q8_0)),
    "qwen2-bias": ("qwen2", dict(bias=True)),
    "qwen3-qknorm": ("qwen3", dict(qk_norm=True)),
}


def split_fused_experts(tensors, experts):
    """transformers 5 keeps Qwen3-MoE experts fused: gate_up_proj [E, 2F, D] (gate rows first) and
    down_proj [E, D, F]; checkpoints (and jaxllm) name each expert's matrices."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            F = t.shape[1] // 2
            for e in range(experts):
                out[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = t[e, :F]
                out[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = t[e, F:]
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(experts):
                out[name.replace("down_proj", f"{e}.down_proj.weight")] = t[e]
        else:
            out[name] = t
    return out


def fused_name(name):
    parts = name.split(".")
    if "experts" in parts and parts[-2] in ("gate_proj", "up_proj", "down_proj"):
        i = parts.index("experts")
        return ".".join(parts[:i + 1] + ["down_proj" if parts[-2] == "down_proj" else "gate_up_proj"])
    return name


@pytest.mark.parametrize("case", list(TINY))
def test_tiny_families_match_transformers(tmp_path, case):
    arch, kwargs = TINY[case]
    path = tmp_path / "tiny.gguf"
    original = write_tiny(path, arch, **kwargs)
    config, ours = read_gguf(path)
    theirs_config, theirs, state_names = transformers_gguf(path)
    theirs = split_fused_experts(theirs, kwargs.get("experts", 0))
    assert set(ours) == set(theirs)
    assert {fused_name(n) for n in ours} == state_names - ({"lm_head.weight"} if config["tie_word_embeddings"] else set())
    for name, ref in theirs.items():
        np.testing.assert_allclose(ours[name], ref, rtol=0, atol=1e-6, err_msg=name)
    if kwargs.get("quant") is None:
        # float32 files round-trip exactly: the Q/K permutation is undone, nothing else changes
        for name, ref in original.items():
            np.testing.assert_array_equal(ours[name], ref, err_msg=name)
    assert config["model_type"] == theirs_config.model_type == {"qwen3moe": "qwen3_moe"}.get(arch, arch)
    assert config["tie_word_embeddings"] == theirs_config.tie_word_embeddings == kwargs.get("tied", True)
    # Qwen2's config derives the head size instead of storing it
    theirs_head_dim = getattr(theirs_config, "head_dim", None) or theirs_config.hidden_size // theirs_config.num_attention_heads
    assert config["head_dim"] == theirs_head_dim == 128
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "vocab_size", "max_position_embeddings"):
        assert config[key] == getattr(theirs_config, key), key


@pytest.mark.parametrize("split", [False, True])
def test_mixtral_style_llama_file(tmp_path, split):
    # llama.cpp writes Mixtral with the llama architecture plus experts; transformers' GGUF path
    # cannot load it, so the reference is the weights the file was written from
    path = tmp_path / "mixtral.gguf"
    original = write_tiny(path, "llama", experts=4, split_experts=split)
    config, ours = read_gguf(path)
    assert (config["model_type"], config["architectures"]) == ("mixtral", ["MixtralForCausalLM"])
    assert (config["num_local_experts"], config["num_experts_per_tok"], config["intermediate_size"]) == (4, 2, 96)
    assert set(ours) == set(original)
    for name, ref in original.items():
        np.testing.assert_array_equal(ours[name], ref, err_msg=name)


def test_llama_qk_bias_is_unpermuted(tmp_path):
    # transformers' llama config has no attention_bias from GGUF and drops these; llama.cpp keeps them
    path = tmp_path / "bias.gguf"
    original = write_tiny(path, "llama", bias=True)
    config, ours = read_gguf(path)
    assert config["attention_bias"] is True
    for name in ("model.layers.1.self_attn.q_proj.bias", "model.layers.1.self_attn.k_proj.bias"):
        np.testing.assert_array_equal(ours[name], original[name])
        assert not np.array_equal(llama_cpp_permute(original[name], 1), original[name])


def llama3_factors(H, theta, factor, low, high, original):
    """convert_hf_to_gguf.py's LlamaModel rope_freqs, for Llama 3.1-style rope_scaling."""
    freqs = 1.0 / theta ** (np.arange(0, H, 2, dtype=np.float64) / H)
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out)


def test_llama3_rope_scaling_recovered_from_rope_freqs(tmp_path):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    path = tmp_path / "llama3.gguf"
    factors = llama3_factors(128, 500000.0, 8.0, 1.0, 4.0, 8192)
    write_tiny(path, "llama", rope_freqs=factors, rope_theta=500000.0)
    config, ours = read_gguf(path)
    assert "rope_freqs.weight" not in ours
    assert config["rope_scaling"]["rope_type"] == "llama3"
    assert config["rope_scaling"]["factor"] == pytest.approx(8.0)
    assert config["rope_scaling"]["original_max_position_embeddings"] == 8192
    # what matters: transformers' llama3 RoPE under our config gives llama.cpp's frequencies
    hf = LlamaConfig(**{k: v for k, v in config.items() if k not in ("rope_scaling", "rope_theta")},
                     rope_parameters={"rope_theta": config["rope_theta"], **config["rope_scaling"]})
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    expected = 1.0 / 500000.0 ** (np.arange(0, 128, 2) / 128) / factors
    np.testing.assert_allclose(inv_freq.numpy(), expected, rtol=1e-5)


# --- malformed files ---------------------------------------------------------------------------

@pytest.mark.parametrize("size", [1 << 20, 10 << 20])
def test_truncated_default_model(tmp_path, size):
    path = tmp_path / f"cut{size}.gguf"
    path.write_bytes(default_model_path().read_bytes()[:size])
    with pytest.raises(ValueError, match="truncated") as e:
        read_gguf(path)
    assert str(path) in str(e.value)


def test_random_bytes(tmp_path):
    path = tmp_path / "noise.gguf"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ValueError, match="magic") as e:
        read_gguf(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("seed", range(8))
def test_random_bytes_after_a_valid_magic(tmp_path, seed):
    # version 3, then noise: counts and lengths are garbage and must be caught, not looped over
    path = tmp_path / "noise.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<I", 3) + np.random.default_rng(seed).bytes(1 << 16))
    with pytest.raises(ValueError) as e:
        read_gguf(path)
    assert str(path) in str(e.value)


def test_huge_metadata_count(tmp_path):
    path = tmp_path / "huge.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1 << 60) + bytes(64))
    with pytest.raises(ValueError, match="truncated"):
        read_gguf_header(path)


def _set_uint32(path, key: str, value: int):
    """Overwrite the uint32 value of metadata `key` in a GGUF file written by `write_tiny`."""
    data = bytearray(path.read_bytes())
    at = data.index(key.encode()) + len(key) + 4  # the key, then its value type (uint32)
    data[at:at + 4] = struct.pack("<I", value)
    path.write_bytes(data)


@pytest.mark.parametrize("arch, key, experts, message", [
    ("llama", "llama.block_count", 0, r"num_hidden_layers must be at most 4096, got 2147483648"),
    ("llama", "llama.expert_count", 4, r"num_local_experts must be at most 4096, got 2147483648"),
])
def test_a_huge_count_is_refused_at_once(tmp_path, arch, key, experts, message):
    """A damaged block or expert count made a name for each block or expert it claimed: a load that
    never returned. It is refused before any is made."""
    path = tmp_path / "huge.gguf"
    write_tiny(path, arch, D=64, N=2, K=1, H=32, F=32, L=1, V=64, experts=experts)
    _set_uint32(path, key, 2**31)
    error = error_within(60, lambda: read_gguf(path), ValueError)
    assert re.search(message, str(error)) and str(path) in str(error), error


def test_more_blocks_than_the_file_holds(tmp_path):
    path = tmp_path / "blocks.gguf"
    write_tiny(path, "llama", D=64, N=2, K=1, H=32, F=32, L=1, V=64)
    _set_uint32(path, "llama.block_count", 4000)
    with pytest.raises(ValueError, match=r"block_count=4000, but the file holds tensors of 1 blocks"):
        read_gguf(path)


def test_deeply_nested_metadata_arrays(tmp_path):
    """Arrays of arrays 100,000 deep (1.2 MB) hit Python's recursion limit: a raw RecursionError."""
    key = b"general.nested"
    nested = struct.pack("<IQ", 9, 1) * 100_000 + struct.pack("<IQI", 4, 1, 7)  # ... an array of one uint32
    path = tmp_path / "nested.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
                     + struct.pack("<I", 9) + nested)
    with pytest.raises(ValueError, match=r"not a valid GGUF file: .*nests arrays more than 16 deep"):
        read_gguf_header(path)


def test_empty_and_missing_file(tmp_path):
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="empty.gguf"):
        read_gguf(tmp_path / "empty.gguf")
    with pytest.raises(FileNotFoundError, match="absent.gguf"):
        read_gguf(tmp_path / "absent.gguf")


def test_unknown_architecture(tmp_path):
    path = tmp_path / "fancy.gguf"
    w = gguf.GGUFWriter(path, "fancyarch")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="fancyarch"):
        read_gguf(path)


def test_unexpected_tensor_is_named(tmp_path):
    # e.g. a Mixtral-style file (llama architecture with experts): fail loudly, never drop weights
    path = tmp_path / "moe.gguf"
    write_tiny(path, "llama", extra_tensors=[("blk.0.ffn_gate_exps.weight", np.zeros((2, 96, 256), np.float32))])
    with pytest.raises(ValueError, match="blk.0.ffn_gate_exps.weight"):
        read_gguf(path)


def test_missing_tensor_is_named(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny(path, "qwen3", qk_norm=True, drop=("blk.1.attn_k_norm.weight",))
    with pytest.raises(ValueError, match="model.layers.1.self_attn.k_norm.weight"):
        read_gguf(path)


def test_loading_never_unpickles(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("unpickling during GGUF load")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(np, "load", refuse)
    path = tmp_path / "tiny.gguf"
    write_tiny(path, "qwen3", qk_norm=True)
    config, tensors = read_gguf(path)
    assert config["model_type"] == "qwen3" and len(tensors) == 2 + 2 * 11


# --- every quant type the gguf package dequantizes ---------------------------------------------

QUANTIZABLE = {t for t in gguf.GGMLQuantizationType
               if t not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)}


def packed_bytes(t, qtype, rng):
    """`t` packed as `qtype`: by gguf's own quantizer where it has one, else random blocks whose
    bytes are all below 0x3C, so every float16 or 8-bit exponent a block holds is finite and
    small (the IQ grids and K-quant scales are then still exercised, on real bit patterns)."""
    try:
        return gguf.quants.quantize(t, qtype)
    except NotImplementedError:
        shape = gguf.quant_shape_to_byte_shape(t.shape, qtype)
        return rng.integers(0, 0x3C, shape, dtype=np.uint8)


@pytest.mark.parametrize("qtype", sorted((t for t in QUANTIZABLE if jaxllm_gguf.dequantizable(t)),
                                         key=lambda t: t.value), ids=lambda t: t.name)
def test_every_dequantizable_type_loads(tmp_path, monkeypatch, qtype):
    """Each tensor equals gguf's own dequantization of its bytes (Q/K rows unpermuted), read a
    few rows at a time so the blocks that split heads and matrices are exercised too."""
    rng = np.random.default_rng(qtype.value)
    path = tmp_path / "q.gguf"
    dims = dict(D=256, N=2, K=1, H=128, F=256, L=1, V=64)
    hf = hf_weights(**dims, bias=False, qk_norm=False, tied=False)
    w = gguf.GGUFWriter(path, "llama")
    for add, value in [("block_count", 1), ("context_length", 64), ("embedding_length", 256),
                       ("feed_forward_length", 256), ("head_count", 2), ("head_count_kv", 1),
                       ("rope_dimension_count", 128), ("layer_norm_rms_eps", 1e-6)]:
        getattr(w, "add_" + add)(value)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(64)])
    packed = {}
    for name, t in hf.items():
        g = gguf_name(name)
        if t.ndim == 2:
            t = llama_cpp_permute(t, 2) if ".attn_q." in g else llama_cpp_permute(t, 1) if ".attn_k." in g else t
            packed[name] = packed_bytes(t, qtype, rng)
            w.add_tensor(g, packed[name], raw_dtype=qtype)
        else:
            w.add_tensor(g, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert {i.ggml_type for i in read_gguf_header(path).tensors.values()} == {qtype, 0}
    monkeypatch.setattr(jaxllm_gguf, "_CHUNK_VALUES", 640)  # two rows of 256 at a time
    _, ours = read_gguf(path)
    for name, raw in packed.items():
        expected = gguf.quants.dequantize(raw, qtype)
        heads = 2 if ".q_proj." in name else 1 if ".k_proj." in name else None
        got = ours[name] if heads is None else llama_cpp_permute(ours[name], heads)
        np.testing.assert_array_equal(got, expected, err_msg=name)


def write_f64_tensor_file(path):
    """A tiny llama file whose v_proj is stored as F64, a type gguf.quants cannot dequantize."""
    write_tiny(path, "llama", drop=("blk.1.attn_v.weight",),
               extra_tensors=[("blk.1.attn_v.weight", np.zeros((128, 256), np.float64))])


def test_a_type_gguf_cannot_dequantize_names_tensor_and_type(tmp_path):
    import jaxllm

    path = tmp_path / "f64.gguf"
    write_f64_tensor_file(path)
    message = "tensor 'blk.1.attn_v.weight' is stored as F64, which the gguf package cannot dequantize"
    with pytest.raises(ValueError, match=re.escape(message)):
        read_gguf(path)
    with pytest.raises(ValueError, match=re.escape(message)):
        jaxllm.load(path)


def test_load_in_bfloat16_equals_float32_then_cast(tmp_path, monkeypatch):
    """Dequantized straight into bfloat16 (no float32 model in between), and the cache written in
    bfloat16 serves the second load the same values."""
    import jax
    import jax.numpy as jnp
    import jaxllm

    monkeypatch.setenv("JAXLLM_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "q8.gguf"
    write_tiny(path, "llama", quant=Q8_0, tied=False)
    reference = jaxllm.load(path, dtype="float32")
    first = jaxllm.load(path, dtype="bfloat16")
    assert len(list((tmp_path / "cache").glob("*bfloat16*/model.safetensors"))) == 1
    monkeypatch.setattr(jaxllm_gguf, "gguf_source", lambda *a: pytest.fail("the GGUF was read again"))
    second = jaxllm.load(path, dtype="bfloat16")
    for ref, a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(first), jax.tree.leaves(second)):
        assert a.dtype == b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a), np.asarray(ref.astype(jnp.bfloat16)))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("kwargs", [dict(experts=4), dict(bias=True, tied=False)], ids=["experts", "bias"])
def test_reading_a_few_rows_at_a_time_gives_the_written_weights(tmp_path, monkeypatch, kwargs):
    """Blocks smaller than a head or an expert: rows unpermuted and experts sliced as a whole read."""
    monkeypatch.setattr(jaxllm_gguf, "_CHUNK_VALUES", 640)
    path = tmp_path / "tiny.gguf"
    original = write_tiny(path, "llama", **kwargs)
    _, ours = read_gguf(path)
    assert set(ours) == set(original)
    for name, ref in original.items():
        np.testing.assert_array_equal(ours[name], ref, err_msg=name)


# --- memory: a few hundred MB file loads without a float32 copy of the model -------------------

def write_random_llama_f16(path, *, V=32000, D=1024, N=16, K=4, H=64, F=2816, L=8):
    """A random llama-layout GGUF of float16 matrices (~310 MB); returns the bfloat16 bytes of
    its weights and its parameter count. Random finite float16 bits, drawn cheaply."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    for add, value in [("block_count", L), ("context_length", 256), ("embedding_length", D),
                       ("feed_forward_length", F), ("head_count", N), ("head_count_kv", K),
                       ("rope_dimension_count", H), ("layer_norm_rms_eps", 1e-6)]:
        getattr(w, "add_" + add)(value)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["<|endoftext|>"] + [f"t{i}" for i in range(V - 1)])
    w.add_token_types([3] + [1] * (V - 1))
    w.add_eos_token_id(0)
    shapes = {"token_embd.weight": (V, D), "output.weight": (V, D), "output_norm.weight": (D,)}
    for i in range(L):
        shapes |= {f"blk.{i}.attn_q.weight": (N * H, D), f"blk.{i}.attn_k.weight": (K * H, D),
                   f"blk.{i}.attn_v.weight": (K * H, D), f"blk.{i}.attn_output.weight": (D, N * H),
                   f"blk.{i}.ffn_gate.weight": (F, D), f"blk.{i}.ffn_up.weight": (F, D),
                   f"blk.{i}.ffn_down.weight": (D, F), f"blk.{i}.attn_norm.weight": (D,),
                   f"blk.{i}.ffn_norm.weight": (D,)}
    for name, shape in shapes.items():
        if len(shape) == 1:
            w.add_tensor(name, np.ones(shape, np.float32))
        else:  # sign, exponent below 16 (|x| < 2), any mantissa: finite
            bits = rng.integers(0, 1 << 16, shape, dtype=np.uint16) & np.uint16(0xBBFF)
            w.add_tensor(name, bits.view(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    count = sum(math.prod(s) for s in shapes.values())
    return 2 * count, count


MEMORY_CHILD = """
import json, os, sys
import jax
jax.devices()
import jaxllm, jaxllm.io.gguf, jaxllm.text.tokenizer  # imported before measuring

def status(key):  # this process's own memory: getrusage's ru_maxrss keeps the parent's peak at fork
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

before = status("VmRSS")
params = jax.block_until_ready(jaxllm.load(sys.argv[1], dtype="bfloat16"))
print(json.dumps({"growth": status("VmHWM") - before, "dtype": str(params.dtype)}))
"""


@pytest.mark.slow
def test_loading_a_gguf_holds_no_float32_copy_of_the_model(tmp_path):
    """Loaded in bfloat16 in a fresh process, the peak RSS grows by the model's bfloat16 weights
    (on the CPU backend the device arrays are host memory) plus a bounded overhead, not by a
    float32 copy of the model (the old path held 2x the bf16 size in float32, then a cache of it)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import jaxllm

    path = tmp_path / "random.gguf"
    bf16_bytes, _ = write_random_llama_f16(path)
    largest = 2 * 32000 * 1024  # the embedding (and output) matrix in bfloat16
    buffer = 64 << 20
    package = str(Path(jaxllm.__file__).parents[1])  # the jaxllm under test, not an installed one
    env = dict(os.environ, JAXLLM_CACHE=str(tmp_path / "cache"), JAXLLM_LOAD_BUFFER_MB=str(buffer >> 20),
               JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([package, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", MEMORY_CHILD, str(path)], capture_output=True, text=True,
                       env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.splitlines()[-1])
    assert result["dtype"] == "bfloat16"
    # Besides the weights: parameters read but not yet placed (the loader's buffer, which one
    # parameter larger than what is free may exceed), each reading thread's block of 1M values
    # (packed bytes, float32, the cast: under 16 MB; one thread a core, at most 8), and 128 MB
    # for the tokenizer and the allocator's per-thread arenas. The old path grew by over 4x the
    # bf16 size: the model in float32, its serialized cache, then the cast.
    readers = max(1, min(8, os.cpu_count() or 1))
    bound = bf16_bytes + buffer + largest + readers * (16 << 20) + (128 << 20)
    assert result["growth"] < bound, (result["growth"] >> 20, bound >> 20)
    cached = list((tmp_path / "cache").glob("*bfloat16*/model.safetensors"))
    assert len(cached) == 1 and cached[0].stat().st_size < bf16_bytes + (1 << 20)  # cached in bf16
