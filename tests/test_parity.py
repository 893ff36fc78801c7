"""jaxllm against transformers in float32 on tiny random models of every dense family.

End-to-end logits and every layer's hidden state within 1e-4 relative, greedy tokens identical,
and the cached path (prefill + decode_step) equal to one full forward; and RMSNorm's rounding in
bf16, which the float32 models cannot show.
"""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import jaxllm
from jaxllm.families import config_from_hf
from jaxllm.layers import dense as layers
from jaxllm.model import transformer as model
from jaxllm.model.config import ModelConfig, RopeConfig
from tiny_models import OLD_KEYS, VARIANTS, hf_greedy, rel_err, random_tokens

ALL = list(VARIANTS) + [OLD_KEYS]
TOL = 1e-4


@pytest.mark.parametrize("name", ALL)
def test_logits_match_transformers(tiny, name):
    m = tiny(name)
    tokens = random_tokens((2, 40), seed=1)
    got = np.asarray(jaxllm.forward(m.params, tokens))
    assert got.dtype == np.float32
    assert rel_err(got, m.hf_logits(tokens)) < TOL


def _hidden_states(params, tokens_BT):
    """Like transformers' output_hidden_states: the embeddings, the output of each block but the
    last, then the last block's output after the final norm.

    The state after i blocks is jaxllm's own `_hidden` run over the first i layers only. Run
    eagerly: the tiny variants share op shapes, so this costs less than a compilation per variant.
    """
    B, T = tokens_BT.shape
    cache = jaxllm.init_cache(params.config, B, T, params.dtype)
    states = [model._hidden(params.replace(layers=params.layers[:i]), tokens_BT, cache)[0]
              for i in range(len(params.layers) + 1)]
    states[-1] = layers.rms_norm(states[-1], params.final_norm, params.config.rms_norm_eps,
                                 params.config.norm_offset)
    return states


@pytest.mark.parametrize("name", ALL)
def test_hidden_states_match_per_layer(tiny, name):
    m = tiny(name)
    tokens = random_tokens((2, 24), seed=2)
    with torch.no_grad():
        ref = m.hf(torch.as_tensor(tokens, dtype=torch.long), output_hidden_states=True).hidden_states
    got = _hidden_states(m.params, tokens)
    assert len(got) == len(ref) == m.params.config.num_layers + 1
    for i, (g, r) in enumerate(zip(got, ref)):
        assert rel_err(g, r.numpy()) < TOL, f"hidden state after {i} layer(s)"


def test_old_and_new_rope_keys_read_alike(tiny):
    new, old = tiny("llama3"), tiny(OLD_KEYS)
    old_json = json.loads((old.path / "config.json").read_text())
    assert "rope_parameters" not in old_json and old_json["rope_scaling"]["type"] == "llama3"
    # The rewritten file is a valid older config: transformers reads the same rope parameters back.
    old_rope = transformers.AutoConfig.from_pretrained(old.path).rope_parameters
    old_rope.pop("type")  # kept verbatim beside the standardized rope_type
    assert old_rope == transformers.AutoConfig.from_pretrained(new.path).rope_parameters
    cfg_new, cfg_old = config_from_hf(new.path), config_from_hf(old.path)
    assert cfg_old == cfg_new
    assert cfg_new.rope == RopeConfig(theta=10000.0, rope_type="llama3", factor=8.0,
                                      original_max_position_embeddings=32)


# Each variant must exercise its feature: without it, jaxllm's logits move away from transformers'.
FEATURE_OFF = {
    "llama3": lambda c: dataclasses.replace(c, rope=RopeConfig(theta=c.rope.theta)),
    "llama_linear": lambda c: dataclasses.replace(c, rope=RopeConfig(theta=c.rope.theta)),
    "llama_yarn": lambda c: dataclasses.replace(c, rope=RopeConfig(theta=c.rope.theta)),
    "mistral": lambda c: dataclasses.replace(c, sliding_window=None, sliding_layers=()),
    "qwen2_swa": lambda c: dataclasses.replace(c, sliding_window=None, sliding_layers=()),
}


@pytest.mark.parametrize("name", sorted(FEATURE_OFF))
def test_variant_exercises_its_feature(tiny, name):
    m = tiny(name)
    tokens = random_tokens((1, 40), seed=1)
    altered = m.params.replace(config=FEATURE_OFF[name](m.params.config))
    assert rel_err(jaxllm.forward(altered, tokens), m.hf_logits(tokens)) > 100 * TOL


def test_sliding_layers_follow_max_window_layers(tiny):
    cfg = tiny("qwen2_swa").params.config
    assert cfg.sliding_window == 4 and cfg.sliding_layers == (False, True, True)
    assert tiny("mistral").params.config.sliding_layers == (True, True)
    assert tiny("qwen2").params.config.sliding_window is None


# generate and the cached path compile per config (seconds each on a CPU): they run on one variant
# of each code path. The rope variants differ from llama only in constant tables, checked above.
# (Plain llama's greedy tokens are compared with transformers in test_generate, with a penalty.)
GREEDY = ["llama3", "llama_bias", "mistral", "qwen2_swa", "qwen3", "gemma2", "gemma3"]
CACHED = ["llama_yarn", "mistral", "qwen2_swa", "qwen3", "gemma2", "gemma3"]


@pytest.mark.slow
@pytest.mark.parametrize("name", GREEDY)
def test_greedy_tokens_match_transformers(tiny, name):
    m = tiny(name)
    prompt = random_tokens((2, 12), seed=3)
    out = jaxllm.generate(m.params, prompt, max_new_tokens=20)
    ref, lengths = hf_greedy(m.hf, m.params.config, prompt, 20)
    np.testing.assert_array_equal(np.asarray(out.tokens), ref)
    np.testing.assert_array_equal(np.asarray(out.lengths), lengths)


@pytest.mark.slow
def test_dynamic_rope_up_to_the_end_of_the_context(tiny):
    """Within max_position_embeddings dynamic NTK leaves the base alone, even when the bucketed
    cache (left padding + spare steps) has more slots than the context."""
    m = tiny("llama_dynamic")
    context = m.params.config.max_position_embeddings
    prompt = random_tokens((1, 20), seed=5)
    out = jaxllm.generate(m.params, prompt, max_new_tokens=context - 20, eos_token_ids=[])
    ref, _ = hf_greedy(m.hf, m.params.config, prompt, context - 20)
    np.testing.assert_array_equal(np.asarray(out.tokens), ref)
    # The same for the low-level path with a cache longer than the context.
    logits, _ = jaxllm.prefill(m.params, prompt, jaxllm.init_cache(m.params.config, 1, 2 * context,
                                                                   m.params.dtype))
    assert rel_err(logits, m.hf_logits(prompt)[:, -1]) < TOL


@pytest.mark.parametrize("name", CACHED)
def test_cached_decode_equals_full_forward(tiny, name):
    """prefill 12 tokens, then decode the rest one at a time: each step equals forward there."""
    m = tiny(name)
    tokens = random_tokens((2, 40), seed=1)  # the shape of the logits test: forward compiles once
    full = np.asarray(jaxllm.forward(m.params, tokens))
    cache = jaxllm.init_cache(m.params.config, 2, 48, m.params.dtype)
    logits, cache = jaxllm.prefill(m.params, tokens[:, :12], cache)
    assert rel_err(logits, full[:, 11]) < 1e-5
    for t in range(12, 40):
        logits, cache = jaxllm.decode_step(m.params, tokens[:, t], cache)
        assert rel_err(logits, full[:, t]) < 1e-5, f"decode at position {t}"
    assert np.asarray(cache.end).tolist() == [40, 40]


def test_rms_norm_in_bfloat16_is_transformers():
    """In bf16 the statistics are float32 and the normed value is rounded to bf16 before the
    weight multiplies it, as LlamaRMSNorm does: the same bits but for float32 rounding of the
    rsqrt (a bf16 unit in the last place at most, in under 1% of values). Statistics taken in
    bf16 give values several units off."""
    gen = torch.Generator().manual_seed(0)
    D = 576
    x = (torch.randn(64, D, generator=gen) * 3 + 0.5).to(torch.bfloat16)
    w = (1 + 0.2 * torch.randn(D, generator=gen)).to(torch.bfloat16)
    hf = transformers.models.llama.modeling_llama.LlamaRMSNorm(D, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        hf.weight.copy_(w)
        ref = hf(x).float().numpy()
    got = np.asarray(layers.rms_norm(jnp.asarray(x.float().numpy(), jnp.bfloat16),
                                     jnp.asarray(w.float().numpy(), jnp.bfloat16), 1e-5).astype(jnp.float32))
    ulp = np.abs(ref) * 2.0 ** -7  # a bf16 unit at each value, within a factor of 2
    off = np.abs(got - ref)
    assert (off <= ulp + 1e-30).all(), off.max()
    assert (off > 0).mean() < 0.01, (off > 0).mean()
