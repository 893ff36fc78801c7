"""Tiny random Hugging Face models of the dense families, the reference for parity tests.

Each variant is a transformers config small enough to build, save and run in well under a second
on a CPU, yet with every family switch that jaxllm implements turned on somewhere: GQA, tied and
untied embeddings, each RoPE scaling type (with parameters chosen so the scaling really changes
the frequencies), attention biases, sliding windows short enough to mask inside a 12-token prompt,
per-head q/k norms and an explicit head_dim; Gemma 2 with soft caps small enough to bite and a
query_pre_attn_scalar that is not the head size, Gemma 3 with a local rope unlike its global one.

transformers initialises norms to one and biases to zero, which would hide a swapped norm or a
dropped bias; `build` re-draws every parameter, and scales matrices so logits are spread out
(greedy picks then have clear margins).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
import transformers

VOCAB = 256
MAX_POS = 256

_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POS,
             rms_norm_eps=0.1, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def _rope(rope_type="default", theta=10000.0, **extra):
    return {"rope_type": rope_type, "rope_theta": theta, **extra}


# name -> (config class, overrides of _BASE)
VARIANTS: dict[str, tuple[type, dict]] = {
    "llama": (transformers.LlamaConfig, dict(num_hidden_layers=3, rope_parameters=_rope())),
    "llama_tied": (transformers.LlamaConfig, dict(tie_word_embeddings=True, num_key_value_heads=4,
                                                  rope_parameters=_rope(theta=500000.0))),
    # theta 1e4 with head dim 16 gives wavelengths 6..6000: with an original context of 32, some
    # frequencies stay, one is smoothed and the rest are divided by the factor.
    "llama3": (transformers.LlamaConfig, dict(rope_parameters=_rope(
        "llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32))),
    "llama_linear": (transformers.LlamaConfig, dict(rope_parameters=_rope("linear", factor=4.0))),
    "llama_yarn": (transformers.LlamaConfig, dict(rope_parameters=_rope(
        "yarn", factor=4.0, original_max_position_embeddings=64))),
    # Dynamic NTK only changes the base beyond max_position_embeddings; used within the context,
    # a short one so a test can generate up to its end cheaply.
    "llama_dynamic": (transformers.LlamaConfig, dict(max_position_embeddings=64,
                                                     rope_parameters=_rope("dynamic", factor=2.0))),
    "llama_bias": (transformers.LlamaConfig, dict(attention_bias=True, rope_parameters=_rope())),
    "mistral": (transformers.MistralConfig, dict(sliding_window=4, head_dim=16, rope_parameters=_rope())),
    "qwen2": (transformers.Qwen2Config, dict(rope_parameters=_rope(theta=1000000.0))),
    # Layers 1 and 2 slide (i >= max_window_layers), layer 0 sees everything.
    "qwen2_swa": (transformers.Qwen2Config, dict(num_hidden_layers=3, use_sliding_window=True,
                                                 sliding_window=4, max_window_layers=1,
                                                 rope_parameters=_rope())),
    # head_dim 32 while D / N = 16; tied embeddings as in the small Qwen3 checkpoints.
    "qwen3": (transformers.Qwen3Config, dict(head_dim=32, tie_word_embeddings=True,
                                             rope_parameters=_rope(theta=1000000.0))),
    # Layers 0 and 2 slide over 4 tokens (Gemma 2 alternates); scores and logits capped at values
    # the random weights exceed; tied, as llama.cpp always has it.
    "gemma2": (transformers.Gemma2Config, dict(
        num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=4,
        attn_logit_softcapping=3.0, final_logit_softcapping=5.0, tie_word_embeddings=True,
        rope_parameters=_rope())),
    # Two sliding layers rotating with base 100, then a global one with linear scaling; untied.
    "gemma3": (transformers.Gemma3TextConfig, dict(
        num_hidden_layers=3, head_dim=32, query_pre_attn_scalar=24, sliding_window=4,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": _rope(theta=100.0),
                         "full_attention": _rope("linear", theta=10000.0, factor=4.0)})),
}

# The same llama3 model, its config.json rewritten with the pre-transformers-5 keys.
OLD_KEYS = "llama3_old_keys"
# The same Gemma 3 model, its config.json with the keys of configs published before transformers 5
# (rope_theta, rope_scaling and rope_local_base_freq; no layer_types but sliding_window_pattern).
GEMMA3_OLD_KEYS = "gemma3_old_keys"
_REWRITTEN = {OLD_KEYS: "llama3", GEMMA3_OLD_KEYS: "gemma3"}


def hf_config(name: str) -> transformers.PretrainedConfig:
    cls, overrides = VARIANTS[_REWRITTEN.get(name, name)]
    return cls(**{**_BASE, **overrides})


def _randomize(model: torch.nn.Module, seed: int):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights appear once
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.2 * noise)
            elif "embed_tokens" in name:
                p.copy_(0.5 * noise)
            else:  # [out, in] projections
                p.copy_(noise * (1.5 / math.sqrt(p.shape[1])))


def build(name: str, directory: Path, seed: int = 0, **overrides) -> torch.nn.Module:
    """Build variant `name` (its config changed in `overrides`) with random weights, save it to
    `directory`, return the torch model."""
    torch.manual_seed(seed)
    config = hf_config(name)
    for key, value in overrides.items():
        setattr(config, key, value)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _randomize(model, seed)
    model.save_pretrained(directory)
    if name == OLD_KEYS:
        write_old_rope_keys(directory)
    if name == GEMMA3_OLD_KEYS:
        write_old_gemma3_keys(directory)
    return model


def write_old_rope_keys(directory: Path):
    """Rewrite config.json's `rope_parameters` as the older `rope_theta` + `rope_scaling` pair."""
    path = Path(directory) / "config.json"
    c = json.loads(path.read_text())
    rope = dict(c.pop("rope_parameters"))
    c["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")  # the oldest spelling of the key
    c["rope_scaling"] = rope
    path.write_text(json.dumps(c, indent=2))


def write_old_gemma3_keys(directory: Path):
    """Rewrite a Gemma 3 config.json as configs before transformers 5 were: the global rope as
    rope_theta + rope_scaling, the local base as rope_local_base_freq, the sliding layers as
    sliding_window_pattern (every 3rd layer global, as the model's layer_types have it)."""
    path = Path(directory) / "config.json"
    c = json.loads(path.read_text())
    rope = c.pop("rope_parameters")
    full = dict(rope["full_attention"])
    c["rope_theta"] = full.pop("rope_theta")
    c["rope_scaling"] = full
    c["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
    assert c.pop("layer_types") == ["sliding_attention", "sliding_attention", "full_attention"]
    c["sliding_window_pattern"] = 3
    path.write_text(json.dumps(c, indent=2))


def rel_err(actual, reference) -> float:
    """max |a - b| / max |b|: the parity measure of every float32 comparison."""
    actual, reference = np.asarray(actual, np.float64), np.asarray(reference, np.float64)
    assert actual.shape == reference.shape, (actual.shape, reference.shape)
    return float(np.abs(actual - reference).max() / np.abs(reference).max())


def random_tokens(shape, seed=0) -> np.ndarray:
    """Token ids in [3, V): 0..2 are pad/bos/eos of the tiny models, nothing is special by accident."""
    return np.random.default_rng(seed).integers(3, VOCAB, shape).astype(np.int32)


def hf_greedy(model, config, prompt, new: int, **generation) -> tuple[np.ndarray, np.ndarray]:
    """transformers' greedy tokens [B, new] and lengths, with the stop ids and pad id of jaxllm's
    ModelConfig `config`; `generation` adds GenerationConfig fields (repetition_penalty...)."""
    gen_cfg = transformers.GenerationConfig(do_sample=False, max_new_tokens=new,
                                            eos_token_id=list(config.eos_token_ids),
                                            pad_token_id=config.pad_id, **generation)
    ids = torch.as_tensor(prompt, dtype=torch.long)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen_cfg)
    out = out[:, prompt.shape[1]:].numpy()
    out = np.pad(out, ((0, 0), (0, new - out.shape[1])), constant_values=config.pad_id)
    lengths = []
    for row in out:
        stops = np.flatnonzero(np.isin(row, config.eos_token_ids))
        lengths.append(stops[0] + 1 if len(stops) else new)
    return out, np.array(lengths)
