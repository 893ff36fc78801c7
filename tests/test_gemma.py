"""Gemma 2 and Gemma 3 against transformers in float32, on the tiny random models of
tests/tiny_models.py and on GGUF files written from them in llama.cpp's layout.

test_parity runs the logits, per-layer hidden states, greedy tokens and cached decode of every
variant, these two included; here: that each Gemma feature matters, the config keys published
checkpoints use (sparse Gemma 3 text_configs, the pre-transformers-5 rope keys, multimodal
wrappers), ragged batches, GGUF files, the decode kernels the plan gives Gemma (interpreted, against
XLA's forms), and the CLI.
"""

import dataclasses
import json
import shutil

import gguf
import jax
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

import jaxllm
from jaxllm import cli, families, kernels
from jaxllm.cli.generate import stop_ids
from jaxllm.engine.generate import pad_prompts
from jaxllm.io.gguf import gguf_to_hf_config, read_gguf, read_gguf_header
from jaxllm.model import plan as plan_module
from jaxllm.model.params import init_params
from jaxllm.tools import presets
from jaxllm.model.cache import init_cache
from kernel_modes import prefill_and_decode, spy, tune
from test_gguf import transformers_gguf
from tiny_models import GEMMA3_OLD_KEYS, _randomize, build, hf_config, rel_err, random_tokens

TOL = 1e-4
GEMMA = ["gemma2", "gemma3"]

# Each switch must matter on the tiny models: without it, jaxllm's logits leave transformers'.
FEATURE_OFF = {
    "gemma2-attn_softcap": ("gemma2", dict(attn_logit_softcap=None)),
    "gemma2-final_softcap": ("gemma2", dict(final_logit_softcap=None)),
    "gemma2-query_scalar": ("gemma2", dict(query_pre_attn_scalar=None)),
    "gemma2-window": ("gemma2", dict(sliding_window=None)),
    "gemma3-local_rope": ("gemma3", dict(local_rope=None)),
    "gemma3-window": ("gemma3", dict(sliding_window=None)),
    "gemma3-embed_scale": ("gemma3", dict(embed_scale=False)),
    "gemma3-activation": ("gemma3", dict(activation="silu")),
}


@pytest.mark.parametrize("case", sorted(FEATURE_OFF))
def test_each_gemma_switch_is_exercised(tiny, case):
    name, off = FEATURE_OFF[case]
    m = tiny(name)
    tokens = random_tokens((2, 40), seed=1)  # the shape of test_parity's logits test
    assert rel_err(jaxllm.forward(m.params, tokens), m.hf_logits(tokens)) < TOL
    altered = m.params.replace(config=dataclasses.replace(m.params.config, **off))
    assert rel_err(jaxllm.forward(altered, tokens), m.hf_logits(tokens)) > 100 * TOL


def test_gemma_configs_read_as_transformers_reads_them(tiny):
    g2, g3 = tiny("gemma2").params.config, tiny("gemma3").params.config
    assert g2.sliding_layers == (True, False, True) and g2.local_rope is None
    assert (g2.attn_logit_softcap, g2.final_logit_softcap, g2.query_pre_attn_scalar) == (3.0, 5.0, 24)
    assert g3.sliding_layers == (True, True, False) and g3.qk_norm
    assert (g3.rope.theta, g3.rope.rope_type, g3.rope.factor, g3.local_rope.theta) == (1e4, "linear", 4.0, 100.0)
    assert [g3.rope_of(i).theta for i in range(3)] == [100.0, 100.0, 1e4]
    assert g3.attn_logit_softcap is None and g3.final_logit_softcap is None
    for cfg in (g2, g3):
        assert (cfg.norm_offset, cfg.activation, cfg.post_norms, cfg.embed_scale) == (1.0, "gelu_tanh", True, True)


def test_pre_transformers_5_gemma3_keys_read_alike(tiny):
    """rope_theta + rope_scaling (global), rope_local_base_freq and sliding_window_pattern, as
    Gemma 3 checkpoints published before transformers 5 have them: transformers and jaxllm read
    the same model from them as from the new keys."""
    new, old = tiny("gemma3"), tiny(GEMMA3_OLD_KEYS)
    old_json = json.loads((old.path / "config.json").read_text())
    assert "rope_parameters" not in old_json and "layer_types" not in old_json
    theirs_new = transformers.AutoConfig.from_pretrained(new.path)
    theirs_old = transformers.AutoConfig.from_pretrained(old.path)
    assert theirs_old.layer_types == theirs_new.layer_types
    for kind in ("full_attention", "sliding_attention"):
        assert {k: v for k, v in theirs_old.rope_parameters[kind].items() if k != "type"} == \
            theirs_new.rope_parameters[kind]
    assert old.params.config == new.params.config
    tokens = random_tokens((2, 40), seed=1)
    assert rel_err(jaxllm.forward(old.params, tokens), old.hf_logits(tokens)) < TOL


# The configs of google/gemma-3-4b-it (a multimodal wrapper whose text_config leaves most keys to
# transformers' defaults), google/gemma-3-1b-it and google/gemma-2-2b-it, as published.
GEMMA3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
    "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
    "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16,
                      "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False},
}
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid",
    "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "initializer_range": 0.02,
    "intermediate_size": 6912, "max_position_embeddings": 32768, "model_type": "gemma3_text",
    "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "use_cache": True,
    "vocab_size": 262144,
}
GEMMA2_2B = {
    "architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid",
    "eos_token_id": [1, 107], "final_logit_softcapping": 30.0, "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304,
    "initializer_range": 0.02, "intermediate_size": 9216, "max_position_embeddings": 8192,
    "model_type": "gemma2", "num_attention_heads": 8, "num_hidden_layers": 26,
    "num_key_value_heads": 4, "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "float32",
    "transformers_version": "4.42.4", "use_cache": True, "vocab_size": 256000,
}


def _strip(c: dict) -> dict:
    return {k: v for k, v in c.items() if k not in ("torch_dtype", "transformers_version")}


def test_published_configs_read_as_transformers_fills_them():
    """Every key a published config leaves out takes transformers' default: jaxllm's config of
    the published file equals its config of what transformers makes of it (saved back whole)."""
    wrapped = transformers.Gemma3Config(**_strip(GEMMA3_4B)).text_config.to_dict()
    ours = families.config_from_hf(GEMMA3_4B)
    assert ours == dataclasses.replace(families.config_from_hf(wrapped), eos_token_ids=(1, 106))
    assert (ours.vocab_size, ours.num_heads, ours.num_kv_heads, ours.head_dim, ours.local_rope.theta,
            ours.rope.theta, ours.rope.factor) == (262208, 8, 4, 256, 1e4, 1e6, 8.0)
    assert ours.sliding_layers == tuple((i + 1) % 6 != 0 for i in range(34))
    for published, cls, preset in ((GEMMA3_1B, transformers.Gemma3TextConfig, "gemma3-1b"),
                                   (GEMMA2_2B, transformers.Gemma2Config, "gemma2-2b")):
        full = cls(**_strip(published)).to_dict()
        assert families.config_from_hf(published) == families.config_from_hf(full) == presets.PRESETS[preset]


def test_unknown_and_unsupported_gemma_configs_are_named():
    with pytest.raises(ValueError, match=r"model_type 'gemma7'.*supported model types: .*gemma2, "
                                         r"gemma3_text \(and the text model of gemma3\)"):
        families.config_from_hf({"model_type": "gemma7"})
    with pytest.raises(ValueError, match="unsupported hidden_activation 'relu'"):
        families.config_from_hf({**GEMMA2_2B, "hidden_activation": "relu"})
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        families.config_from_hf({**GEMMA3_1B, "use_bidirectional_attention": True})
    with pytest.raises(ValueError, match="text_config must be of model_type 'gemma3_text'"):
        families.config_from_hf({**GEMMA3_4B, "text_config": {"model_type": "llama"}})


@pytest.mark.slow
@pytest.mark.parametrize("name", GEMMA)
def test_ragged_prefill_and_decode_logits_match_each_row_alone(tiny, name):
    """Left padding, per-row positions, a window of 4 and (Gemma 3) two ropes: every row's logits
    through prefill and three decode steps are transformers' for that row alone."""
    m = tiny(name)
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
        assert rel_err(got_BTV[b], ref) < TOL, f"row {b}"


@pytest.mark.slow
def test_ragged_generate_rows_equal_rows_alone(tiny):
    params = tiny("gemma3").params
    prompts = [random_tokens(n, seed=n).tolist() for n in (5, 13, 20)]
    out = jaxllm.generate(params, prompts, max_new_tokens=16, eos_token_ids=[])
    for b, prompt in enumerate(prompts):
        alone = jaxllm.generate(params, np.array([prompt], np.int32), max_new_tokens=16, eos_token_ids=[])
        np.testing.assert_array_equal(out.tokens[b], alone.tokens[0], err_msg=f"row {b}")


@pytest.mark.slow
@pytest.mark.parametrize("name", GEMMA)
def test_bf16_is_as_close_to_float32_as_transformers_bf16(tiny, name, tmp_path):
    """In bf16, jaxllm's logits stray from the float32 model's no more than transformers' bf16
    logits do (bf16 results are checked with a bound, never for equality: DESIGN.md)."""
    import copy
    m = tiny(name)
    hf_bf16 = copy.deepcopy(m.hf).to(torch.bfloat16)
    hf_bf16.save_pretrained(tmp_path)
    params = jaxllm.load(tmp_path, dtype="bfloat16")
    tokens = random_tokens((1, 24))
    with torch.no_grad():
        theirs = hf_bf16(torch.as_tensor(tokens)).logits.float().numpy()
    reference = m.hf_logits(tokens)
    ours = np.asarray(jaxllm.forward(params, tokens))
    assert rel_err(ours, reference) < 1.5 * rel_err(theirs, reference)


# Every decode kernel interpreted (on a CPU); rows_project from 2 rows, so that the tiny models'
# steps of 2 rows take it.
KERNELS = dict(decode_project="interpret", decode_attention="interpret", add_norm="interpret",
               rows_project="interpret", route="interpret")
ROWS_FROM_2 = dict(rows_min=2, verify_rows_min=2, rows_large_weights=0)


def test_the_plan_gives_gemma_the_kernels_that_compute_it_and_says_so(tiny, monkeypatch):
    """With every kernel switched on, Gemma's decode steps take the attention kernel (its score
    scale, soft cap, (1 + w) q/k norms and two ropes are the kernel's switches), every matrix as a
    plain product in the projection kernels (GeGLU's tanh GELU in gate/up's) and the residual
    adds with Gemma's post-norms in add_norm's; its (1 + w) norms fold into no matrix and no
    residual into o or down, which the bench's decode_paths cannot show but the plan's layers do."""
    tune(monkeypatch, **KERNELS, **ROWS_FROM_2)
    for name in GEMMA:
        params = tiny(name).params
        fusions = plan_module.model_fusions(params.config)
        assert not fusions.fold_norms and not fusions.fold_residual and not fusions.digits, name
        assert fusions.gate_kernel, name
        one = plan_module.step_plan(params, 1, 1, cache_length=32)
        assert plan_module.describe(one) == dict(
            qkv="project", attention="kernel", o="project", add_norm="kernel", gate_up="project",
            down="project", lm_head="project"), name
        assert not any(lp.ffn_norm_folded or lp.next_folds for lp in one.layers), name
        rows = plan_module.step_plan(params, 2, 1, cache_length=32)
        assert plan_module.describe(rows) == dict(
            qkv="rows", attention="kernel", o="rows", add_norm="kernel", gate_up="rows",
            down="rows", lm_head="xla"), name
        assert not any(lp.next_folds for lp in rows.layers), name
        # exact GELU (no Gemma's, but a config may say it): gate/up and down stay XLA's
        gelu = params.replace(config=dataclasses.replace(params.config, activation="gelu"))
        paths = plan_module.describe(plan_module.step_plan(gelu, 1, 1, cache_length=32))
        assert paths["gate_up"] == paths["down"] == "xla" and paths["qkv"] == "project"
    llama = plan_module.model_fusions(tiny("llama").params.config)
    assert llama.fold_norms and llama.fold_residual and llama.gate_kernel and llama.digits


def _ragged_decode(params, rows: int, steps: int = 10):
    """Prefill 4 tokens of `rows` rows (the last left-padded by 3) into a float32 cache of 32
    slots, then decode `steps` tokens one a step: each step's logits, [steps, rows, V]."""
    ids = random_tokens((2, 4 + steps), seed=3)[-rows:]
    ids[-1, :3] = params.config.pad_id
    cache = init_cache(params.config, rows, 32, jax.numpy.float32, start=jax.numpy.asarray([0, 3][-rows:]))
    return np.stack(prefill_and_decode(params, ids, 4, cache)[1:])


@pytest.mark.parametrize("name, rows", [("gemma2", 1), ("gemma3", 2)])
def test_gemma_decode_steps_through_the_kernels_equal_xlas(tiny, monkeypatch, name, rows):
    """Ten decode steps past the window of 4, a left-padded row, through every kernel the plan
    gives Gemma (one row: `project`'s; two: `rows_project`'s), in float32: the logits are XLA's,
    within float32's rounding; each kernel ran."""
    params = tiny(name).params
    want = _ragged_decode(params, rows)
    tune(monkeypatch, **KERNELS, **ROWS_FROM_2)
    attended = spy(monkeypatch, "decode_attention", lambda qkv, *a: 1, module=kernels)
    normed = spy(monkeypatch, "_add_norm_call", lambda x, d, n, post=None, *a: post is not None)
    projected = spy(monkeypatch, "_rows_call" if rows > 1 else "_project_kernel_call")
    got = _ragged_decode(params, rows)
    assert attended and projected and set(normed) == {True}  # post-norms in the kernel
    assert rel_err(got, want) < 1e-5
    jax.clear_caches()


@pytest.mark.slow
@pytest.mark.parametrize("name, rows", [("gemma2", 2), ("gemma3", 1)])
def test_gemma_decode_steps_through_the_kernels_equal_xlas_and_transformers(tiny, monkeypatch, name,
                                                                              rows):
    """The other pairing of model and path; and the kernels' logits are transformers' (each row
    alone, the padded one without its padding)."""
    m = tiny(name)
    want = _ragged_decode(m.params, rows)
    tune(monkeypatch, **KERNELS, **ROWS_FROM_2)
    got = _ragged_decode(m.params, rows)
    assert rel_err(got, want) < 1e-5
    ids = random_tokens((2, 14), seed=3)[-rows:]
    for b in range(rows):
        row = ids[b, 3:] if b == rows - 1 else ids[b]
        ref = m.hf_logits(row[None])[0, -10:]
        assert rel_err(got[:, b], ref) < TOL, b
    jax.clear_caches()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*recompiling generate")
@pytest.mark.parametrize("name", GEMMA)
def test_gemma_generate_through_the_kernels_keeps_its_tokens(tiny, monkeypatch, name):
    """generate's greedy tokens of a ragged batch and of one row, every step through the kernels
    (the rotation tables, Gemma 3's two, made once before the loop), are XLA's."""
    params = tiny(name).params
    prompts = [random_tokens(n, seed=n).tolist() for n in (5, 13)]
    run = lambda p: np.asarray(jaxllm.generate(params, p, max_new_tokens=12, eos_token_ids=[]).tokens)
    want, want_one = run(prompts), run(prompts[:1])
    tune(monkeypatch, **KERNELS, **ROWS_FROM_2)
    attended = spy(monkeypatch, "decode_attention", lambda qkv, *a: 1, module=kernels)
    np.testing.assert_array_equal(run(prompts), want)
    np.testing.assert_array_equal(run(prompts[:1]), want_one)
    assert attended
    jax.clear_caches()


def test_gemma_norms_init_neutral_and_roofline_counts_the_post_norms(tiny):
    """Random Gemma weights (presets, benchmarks) start with norms of scale 1: weights 0."""
    from jaxllm.tools import roofline

    cfg = tiny("gemma3").params.config
    params = init_params(cfg, jax.random.key(0), np.float32)
    assert not np.asarray(params.final_norm).any() and not np.asarray(params.layers[0].post_mlp_norm).any()
    plain = dataclasses.replace(cfg, post_norms=False, norm_offset=0.0)
    norms = lambda c: next(o for o in roofline.analyze(c, 1, 64, dtype="float32")["ops"] if o["op"] == "norms")
    assert norms(cfg)["weight_bytes"] - norms(plain)["weight_bytes"] == cfg.num_layers * 2 * cfg.hidden_size * 4


# --- multimodal checkpoints -------------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma3_multimodal(tmp_path_factory):
    """A tiny untied Gemma3ForConditionalGeneration as save_pretrained writes it (the Hub's layout:
    language_model.model.*, language_model.lm_head, beside vision_tower.* and the projector)."""
    text = hf_config("gemma3")
    vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                       mm_tokens_per_image=4, eos_token_id=[2, 5], tie_word_embeddings=False)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    _randomize(model.model.language_model, 0)  # the tower keeps its init: it is never read
    with torch.no_grad():
        model.lm_head.weight.copy_(torch.randn(model.lm_head.weight.shape, generator=torch.Generator().manual_seed(1)) / 8)
    path = tmp_path_factory.mktemp("gemma3_mm")
    model.save_pretrained(path)
    return path, model


def test_a_multimodal_gemma3_checkpoint_loads_its_text_model(gemma3_multimodal, tmp_path):
    path, model = gemma3_multimodal
    tokens = random_tokens((2, 24), seed=6)
    with torch.no_grad():
        ref = model(input_ids=torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
    names = set(load_file(path / "model.safetensors"))
    assert "language_model.lm_head.weight" in names and any(n.startswith("vision_tower.") for n in names)
    params = jaxllm.load(path, dtype="float32")
    assert params.config.eos_token_ids == (2, 5) and params.config.model_type == "gemma3_text"
    assert not params.config.tie_word_embeddings
    assert rel_err(jaxllm.forward(params, tokens), ref) < TOL
    # transformers 5's module layout, as other tools save it: model.language_model.*, lm_head,
    # model.vision_tower.*
    other = tmp_path / "other"
    other.mkdir()
    renamed = {}
    for name, x in load_file(path / "model.safetensors").items():
        for old, new in (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                         ("vision_tower.", "model.vision_tower."),
                         ("multi_modal_projector.", "model.multi_modal_projector.")):
            if name.startswith(old):
                name = new + name[len(old):]
                break
        renamed[name] = x
    save_file(renamed, str(other / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(path / "config.json", other / "config.json")
    assert rel_err(jaxllm.forward(jaxllm.load(other, dtype="float32"), tokens), ref) < TOL


# --- GGUF files in llama.cpp's layout -----------------------------------------------------------

GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' "
                  "else m['role'] %}{{ '<start_of_turn>' + role + '\\n' + m['content'] | trim + "
                  "'<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}"
                  "{{ '<start_of_turn>model\\n' }}{% endif %}")
# A Gemma-like SentencePiece vocabulary of the tiny models' 256 ids: pad, bos, eos (the tiny
# configs' 0, 1, 2), unk, the turn markers, pieces, then unused ids.
_PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "ll", "▁w", "or", "ld", "▁wor", "▁world",
           "he", "hell", "hello", "▁hello", "user", "model", "\n"]
TOKENS = (["<pad>", "<bos>", "<eos>", "<unk>", "<start_of_turn>", "<end_of_turn>"] + _PIECES
          + [f"<unused{i}>" for i in range(256 - 6 - len(_PIECES))])
TOKEN_TYPES = [3, 3, 3, 2, 3, 3] + [1] * len(_PIECES) + [5] * (256 - 6 - len(_PIECES))

# HF tensor name -> llama.cpp's (convert_hf_to_gguf.py with gguf-py's tensor map)
_LEAVES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
           "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
           "post_feedforward_layernorm": "post_ffw_norm", "self_attn.q_norm": "attn_q_norm",
           "self_attn.k_norm": "attn_k_norm"}


def gguf_tensor_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    parts = hf_name.split(".")
    return f"blk.{parts[2]}.{_LEAVES['.'.join(parts[3:-1])]}.{parts[-1]}"


def write_gemma_gguf(path, model, *, quant=None, chat_template=GEMMA_TEMPLATE, local_base=True,
                     softcaps=True):
    """Write a tiny HF Gemma model as llama.cpp's converter would: its metadata keys, norm weights
    plus one, lm_head only where untied (Gemma 2's never), the sliding layers as
    sliding_window_pattern (the tiny ones are not llama.cpp's defaults), matrices in `quant`."""
    c = model.config
    arch = {"gemma2": "gemma2", "gemma3_text": "gemma3"}[c.model_type]
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny {arch}")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_sliding_window(c.sliding_window)
    w.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
    if arch == "gemma2":
        w.add_rope_freq_base(c.rope_parameters["rope_theta"])
        if softcaps:
            w.add_attn_logit_softcapping(c.attn_logit_softcapping)
            w.add_final_logit_softcapping(c.final_logit_softcapping)
    else:
        full, local = c.rope_parameters["full_attention"], c.rope_parameters["sliding_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        if local_base:
            w.add_rope_freq_base_swa(local["rope_theta"])
        if full["rope_type"] == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
    w.add_tokenizer_model("llama")
    w.add_token_list(TOKENS)
    w.add_token_types(TOKEN_TYPES)
    w.add_token_scores([0.0] * 6 + [-float(i) for i in range(len(_PIECES))] + [0.0] * (256 - 6 - len(_PIECES)))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_space_prefix(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    if c.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for name, t in state.items():
        if name.endswith("norm.weight"):
            t = t + 1  # Gemma's RMSNorm scales by (1 + w): llama.cpp stores 1 + w
        if quant is not None and t.ndim == 2:
            w.add_tensor(gguf_tensor_name(name), gguf.quants.quantize(t, quant), raw_dtype=quant)
        else:
            w.add_tensor(gguf_tensor_name(name), np.ascontiguousarray(t, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return state


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory):
    """name -> (HF model, GGUF path): the tiny Gemmas with query_pre_attn_scalar = head_dim, as
    llama.cpp derives it for every Gemma but the 27B ones (a GGUF file does not store it)."""
    out = {}
    for name in GEMMA:
        directory = tmp_path_factory.mktemp(f"{name}_gguf")
        model = build(name, directory / "hf", query_pre_attn_scalar=hf_config(name).head_dim)
        write_gemma_gguf(directory / "tiny.gguf", model)
        out[name] = model, directory
    return out


@pytest.mark.parametrize("name", GEMMA)
def test_gguf_tensors_are_the_hf_models_and_transformers_reads_them_alike(gguf_models, name):
    model, directory = gguf_models[name]
    config, ours = read_gguf(directory / "tiny.gguf")
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    assert set(ours) == set(state)
    for k, ref in state.items():  # norms: (1 + w) - 1 in float32, within its rounding
        np.testing.assert_allclose(ours[k], ref, rtol=0, atol=1e-6, err_msg=k)
    _, theirs, _ = transformers_gguf(directory / "tiny.gguf")
    for k, ref in theirs.items():
        np.testing.assert_allclose(ours[k], ref, rtol=0, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("name", GEMMA)
def test_a_gguf_file_loads_the_model_its_hf_directory_does(gguf_models, name, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXLLM_CACHE", str(tmp_path / "cache"))
    model, directory = gguf_models[name]
    from_hf = jaxllm.load(directory / "hf", dtype="float32")
    from_gguf = jaxllm.load(directory / "tiny.gguf", dtype="float32")
    cached = jaxllm.load(directory / "tiny.gguf", dtype="float32")  # the converted copy, read back
    assert len(list((tmp_path / "cache").iterdir())) == 1 and cached.config == from_gguf.config
    for a, b in zip(jax.tree.leaves(cached), jax.tree.leaves(from_gguf), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The file's stop ids add the template's <end_of_turn> (id 5) to its eos; its eps is a float32
    assert from_gguf.config == dataclasses.replace(from_hf.config, eos_token_ids=(2, 5),
                                                   rms_norm_eps=float(np.float32(0.1)))
    tokens = random_tokens((2, 40), seed=1)
    with torch.no_grad():
        ref = model(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
    assert rel_err(jaxllm.forward(from_gguf, tokens), ref) < TOL


def test_a_quantized_gemma_gguf_loads_what_transformers_dequantizes(gguf_models, tmp_path):
    model, _ = gguf_models["gemma3"]
    path = tmp_path / "q8.gguf"
    write_gemma_gguf(path, model, quant=gguf.GGMLQuantizationType.Q8_0)
    _, ours = read_gguf(path)
    _, theirs, _ = transformers_gguf(path)
    assert set(ours) == set(theirs)
    for k, ref in theirs.items():
        np.testing.assert_allclose(ours[k], ref, rtol=0, atol=1e-6, err_msg=k)


def test_gguf_metadata_llama_cpp_leaves_out_takes_its_defaults(gguf_models, tmp_path):
    """Gemma 3 files before rope.freq_base_swa rotate the local layers with base 10000, as
    llama.cpp does; Gemma 2 files without soft-cap keys take transformers' 50 and 30; without
    a sliding_window_pattern key, every 6th (Gemma 3) or 2nd (Gemma 2) layer is global; 27B's
    layer count takes query_pre_attn_scalar from D / N, every other size from head_dim."""
    model3, _ = gguf_models["gemma3"]
    write_gemma_gguf(tmp_path / "g3.gguf", model3, local_base=False)
    c3 = gguf_to_hf_config(tmp_path / "g3.gguf")
    assert families.config_from_hf(c3).local_rope.theta == 10000.0
    model2, _ = gguf_models["gemma2"]
    write_gemma_gguf(tmp_path / "g2.gguf", model2, softcaps=False)
    c2 = families.config_from_hf(gguf_to_hf_config(tmp_path / "g2.gguf"))
    assert (c2.attn_logit_softcap, c2.final_logit_softcap) == (50.0, 30.0)
    for arch, layers, period, scalar in (("gemma3", 62, 6, 5376 // 32), ("gemma2", 46, 2, 4608 // 32),
                                         ("gemma3", 26, 6, 128)):
        path = tmp_path / f"{arch}-{layers}.gguf"
        w = gguf.GGUFWriter(path, arch)
        w.add_block_count(layers)
        w.add_embedding_length(5376 if arch == "gemma3" else 4608)
        w.add_feed_forward_length(64)
        w.add_head_count(32)
        w.add_head_count_kv(16)
        w.add_key_length(128)
        w.add_sliding_window(1024)
        w.add_token_list(TOKENS)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        cfg = families.config_from_hf(gguf_to_hf_config(read_gguf_header(path)))
        assert cfg.query_pre_attn_scalar == scalar
        assert cfg.sliding_layers == tuple((i + 1) % period != 0 for i in range(layers))


def test_gemma_gguf_chat_template_and_its_absence(gguf_models, tmp_path):
    model, directory = gguf_models["gemma3"]
    tok = jaxllm.load_tokenizer(directory / "tiny.gguf")
    text = tok.apply_chat_template([{"role": "user", "content": "hello world"}])
    assert text == "<bos><start_of_turn>user\nhello world<end_of_turn>\n<start_of_turn>model\n"
    assert set(tok.eos_token_ids) == {2, 5}
    ids = tok.encode(text)
    assert ids[:2] == [1, 4] and 5 in ids and max(ids) < 256
    write_gemma_gguf(tmp_path / "bare.gguf", model, chat_template=None)
    bare = jaxllm.load_tokenizer(tmp_path / "bare.gguf")
    with pytest.raises(ValueError, match="has no chat template; pass chat_template= or encode raw text"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


# --- the command line ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma_chat_dir(tmp_path_factory):
    """A tiny Gemma 3 HF directory with a byte-level BPE tokenizer and a Gemma chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = tmp_path_factory.mktemp("gemma_chat")
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<bos>", "<eos>", "<start_of_turn>",
                                                                  "<end_of_turn>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(["hello world, what is the capital of France? Paris. user model"] * 4, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>",
                                                pad_token="<pad>", chat_template=GEMMA_TEMPLATE)
    fast.save_pretrained(out)
    build("gemma3", out, vocab_size=tk.get_vocab_size(), bos_token_id=1, eos_token_id=[2, 4], pad_token_id=0)
    return out


@pytest.mark.slow
def test_jaxllm_generate_on_a_gemma_directory(gemma_chat_dir, capsys):
    assert cli.main(["generate", "hello world", "--model", str(gemma_chat_dir), "--max-new-tokens", "10",
                     "--dtype", "float32"]) == 0
    shown = capsys.readouterr().out
    params = jaxllm.load(gemma_chat_dir, dtype="float32")
    tok = jaxllm.load_tokenizer(gemma_chat_dir)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hello world"}]))
    stops = stop_ids(params, tok)
    assert tok.token_to_id("<end_of_turn>") in stops
    out = jaxllm.generate(params, [ids], max_new_tokens=10, eos_token_ids=stops)
    new = [int(t) for t in out.tokens[0, :int(out.lengths[0])] if int(t) not in stops]
    assert new, "the tiny model stopped at once: the test would compare nothing"
    assert shown == tok.decode(new) + "\n"


def test_a_converted_gemma_checkpoint_restores_it_and_older_ones_still_load(tiny, tmp_path):
    """`jaxllm convert`'s checkpoint keeps the Gemma switches (the local rope a nested object);
    one converted before those fields existed loads with their defaults."""
    from jaxllm.io import checkpoint

    m = tiny("gemma3")
    checkpoint.save(m.params, tmp_path / "gemma3")
    restored = jaxllm.load(tmp_path / "gemma3")
    assert restored.config == m.params.config
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(m.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    llama = tiny("llama").params
    checkpoint.save(llama, tmp_path / "llama")
    config_file = tmp_path / "llama" / checkpoint.CONFIG_FILE
    meta = json.loads(config_file.read_text())
    for key in ("local_rope", "norm_offset", "activation", "post_norms", "embed_scale",
                "query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap"):
        del meta["config"][key]
    config_file.write_text(json.dumps(meta))
    assert jaxllm.load(tmp_path / "llama").config == llama.config
