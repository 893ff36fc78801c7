"""Mixture of experts: Mixtral and Qwen3-MoE against transformers, the router against hand-computed
weights, the two compute paths of `layers.moe` against each other, and expert parallelism on 8 fake
CPU devices (in a subprocess, since the device count is fixed when jax starts).

The tiny models re-draw every weight with spread-out scales, so routing is decisive (a wrong expert
or weight moves the logits far beyond the tolerance) and greedy picks have clear margins. Their
eos is unset, so both sides generate all 16 tokens.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import types
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import jaxllm
from jaxllm import kernels
from jaxllm.families import config_from_hf
from jaxllm.layers import moe as L
from jaxllm.model.config import ModelConfig, RopeConfig
from kernel_modes import decode_per_mode, spy, tune
from tiny_models import rel_err
from jaxllm.layers.quant import quantize
from jaxllm.model.params import abstract_params

VOCAB = 256
_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=None, tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})

# name -> (config class, overrides of _BASE)
VARIANTS = {
    # Mixtral slides its attention window on every layer; 6 masks inside a 12-token prompt.
    "mixtral": (transformers.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2,
                                                 sliding_window=6)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(num_experts=8, num_experts_per_tok=2,
                                                    moe_intermediate_size=32, norm_topk_prob=False,
                                                    head_dim=32)),
    # Sparse where (i + 1) % 2 == 0 and i is not in mlp_only_layers: layer 1 of 4 (3 by the step
    # alone, but listed as dense).
    "qwen3_moe_mixed": (transformers.Qwen3MoeConfig, dict(
        num_hidden_layers=4, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
        norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[3])),
}
NAMES = list(VARIANTS)


def tokens(shape, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, VOCAB, shape).astype(np.int32)


def _randomize(model: torch.nn.Module, seed: int):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif "embed_tokens" in name:
                p.copy_(0.5 * noise)
            else:  # [out, in] projections, [E, out, in] experts, the [E, D] router
                p.copy_(noise * (1.5 / math.sqrt(p.shape[-1])))


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    """moe_model(name) -> namespace(path, hf, params, config), built and saved once per module."""
    built = {}

    def get(name):
        if name not in built:
            cls, overrides = VARIANTS[name]
            config = cls(**{**_BASE, **overrides})
            config._attn_implementation = "eager"
            torch.manual_seed(0)
            hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
            _randomize(hf, seed=0)
            path = tmp_path_factory.mktemp(name)
            hf.save_pretrained(path)
            params = jaxllm.load(path, dtype="float32")
            built[name] = types.SimpleNamespace(path=path, hf=hf, params=params, config=params.config)
        return built[name]
    return get


def _hf_sparse_block(hf, i):
    return hf.model.layers[i].mlp


# --- config and parameters -------------------------------------------------------------------


@pytest.mark.slow
def test_config_reads_moe_fields(moe_model):
    mixtral = moe_model("mixtral").config
    assert (mixtral.num_experts, mixtral.experts_per_token, mixtral.moe_ffn_size) == (4, 2, 96)
    assert mixtral.norm_topk_prob and mixtral.moe_layers == (True, True)
    qwen = moe_model("qwen3_moe").config  # transformers 5 writes num_local_experts for it
    assert (qwen.num_experts, qwen.experts_per_token, qwen.moe_ffn_size) == (8, 2, 32)
    assert not qwen.norm_topk_prob and qwen.moe_layers == (True, True)
    mixed = moe_model("qwen3_moe_mixed")
    assert mixed.config.moe_layers == (False, True, False, False)
    for i, layer in enumerate(mixed.params.layers):
        assert (layer.router is not None) == mixed.config.moe_layers[i]
        assert (layer.w_gate_up is None) == mixed.config.moe_layers[i]
    assert mixed.params.layers[0].w_gate_up.shape == (2, 96, 64)
    assert mixed.params.layers[1].router.shape == (8, 64)
    assert mixed.params.layers[1].experts_gate_up.shape == (8, 2, 32, 64)
    assert mixed.params.layers[1].experts_down.shape == (8, 64, 32)


def test_config_published_spellings_and_defaults():
    base = dict(num_hidden_layers=4, num_attention_heads=4, hidden_size=64, vocab_size=100,
                intermediate_size=96)
    # Qwen3-30B-A3B's config.json spells num_experts and sets norm_topk_prob.
    qwen = config_from_hf({**base, "model_type": "qwen3_moe", "num_experts": 128,
                           "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                           "norm_topk_prob": True, "decoder_sparse_step": 1,
                           "mlp_only_layers": []})
    assert (qwen.num_experts, qwen.experts_per_token, qwen.norm_topk_prob) == (128, 8, True)
    assert qwen.moe_layers == (True,) * 4
    # Absent keys: transformers' defaults (Qwen3MoeConfig.norm_topk_prob is False).
    qwen_default = config_from_hf({**base, "model_type": "qwen3_moe"})
    assert (qwen_default.num_experts, qwen_default.experts_per_token) == (128, 8)
    assert not qwen_default.norm_topk_prob
    # Mixtral always renormalizes, whatever a stray key says.
    mixtral = config_from_hf({**base, "model_type": "mixtral", "norm_topk_prob": False})
    assert (mixtral.num_experts, mixtral.experts_per_token, mixtral.norm_topk_prob) == (8, 2, True)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        config_from_hf({**base, "model_type": "mixtral", "num_local_experts": 4,
                        "num_experts_per_tok": 5})


# --- the router ------------------------------------------------------------------------------

_route = jax.jit(L.route, static_argnums=(2, 3))


def _numpy_route(x_MD, router_ED, k, norm):
    logits = x_MD.astype(np.float64) @ router_ED.T.astype(np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k]  # ties: the lower id first
    weights = np.take_along_axis(probs, ids, -1)
    if norm:
        weights = weights / weights.sum(-1, keepdims=True)
    return ids, weights


def test_router_hand_computed():
    # One input channel, router logits log(1..4): probabilities 0.1, 0.2, 0.3, 0.4.
    router = np.log(np.array([[1.0], [2.0], [3.0], [4.0]], np.float32))  # [E, D]
    ids, weights = _route(jnp.ones((1, 1), jnp.float32), jnp.asarray(router), 2, False)
    np.testing.assert_array_equal(ids, [[3, 2]])
    np.testing.assert_allclose(weights, [[0.4, 0.3]], rtol=1e-6)
    ids, weights = _route(jnp.ones((1, 1), jnp.float32), jnp.asarray(router), 2, True)
    np.testing.assert_array_equal(ids, [[3, 2]])
    np.testing.assert_allclose(weights, [[4 / 7, 3 / 7]], rtol=1e-6)

    # A small batch against numpy; row 0 is all zeros, so all 6 experts tie: lower ids win.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 3)).astype(np.float32)
    x[0] = 0
    router = rng.normal(size=(6, 3)).astype(np.float32)
    for k, norm in [(2, True), (3, False), (1, True)]:
        ids, weights = _route(jnp.asarray(x), jnp.asarray(router), k, norm)
        want_ids, want_weights = _numpy_route(x, router, k, norm)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_allclose(weights, want_weights, rtol=1e-5)
        assert weights.dtype == jnp.float32
    np.testing.assert_array_equal(_route(jnp.asarray(x), jnp.asarray(router), 3, False)[0][0],
                                  [0, 1, 2])


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_router_matches_transformers(moe_model, name):
    m = moe_model(name)
    x = np.random.default_rng(1).normal(size=(64, 64)).astype(np.float32)
    with torch.no_grad():
        _, scores, ids = _hf_sparse_block(m.hf, 0).gate(torch.from_numpy(x))
    got_ids, got_weights = _route(jnp.asarray(x), m.params.layers[0].router,
                                  m.config.experts_per_token, m.config.norm_topk_prob)
    np.testing.assert_array_equal(got_ids, ids.numpy())
    np.testing.assert_allclose(got_weights, scores.numpy(), rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("E,A,norm", [(128, 8, True), (8, 2, True), (60, 4, False), (5, 5, True)])
def test_routing_kernel_picks_as_xla(E, A, norm):
    """kernels.route's kernel (interpreted) picks the experts layers.route picks, in its order,
    with its weights: bf16 logits, tied experts (a duplicated router row; a zero row, where all
    tie and the lowest ids win), E and A not powers of two."""
    rng = np.random.default_rng(E + A)
    x = jnp.asarray(rng.normal(size=(6, 32)), jnp.bfloat16).at[0].set(0)
    router = rng.normal(size=(E, 32)).astype(np.float32)
    router[E - 1] = router[1]  # a tie between experts 1 and E - 1
    router = jnp.asarray(router, jnp.bfloat16)
    want_ids, want_weights = L.route(x, router, A, norm)
    ids, weights = kernels.route(x, router, A, norm, mode="interpret")
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_weights, rtol=1e-6)
    assert ids.dtype == jnp.int32 and weights.dtype == jnp.float32
    np.testing.assert_array_equal(ids[0], np.arange(A))  # all tied: the lowest ids, in order


# --- the MoE layer ---------------------------------------------------------------------------


@partial(jax.jit, static_argnums=(4, 5))
def _all_paths(x, router, gate_up, down, experts_per_token, norm_topk_prob):
    """{path: moe output} for the automatic choice and each forced path, in one compilation."""
    return {str(path): L.moe(x, router, gate_up, down, experts_per_token, norm_topk_prob, path=path)
            for path in (None, "gather", "dense", "ragged")}


def _numpy_moe(x_BTD, router_ED, gate_up_EJFD, down_EDF, k, norm):
    """The layer written out token by token in float64: the oracle for random weights."""
    x_MD = np.asarray(x_BTD, np.float64).reshape(-1, x_BTD.shape[-1])
    ids, weights = _numpy_route(x_MD, np.asarray(router_ED), k, norm)
    out = np.zeros_like(x_MD)
    for m, x in enumerate(x_MD):
        for e, w in zip(ids[m], weights[m]):
            gate, up = np.asarray(gate_up_EJFD[e], np.float64) @ x
            out[m] += w * (np.asarray(down_EDF[e], np.float64) @ (gate / (1 + np.exp(-gate)) * up))
    return out.reshape(x_BTD.shape)


def _random_experts(E, D, F, seed):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(E, D)).astype(np.float32),
            (rng.normal(size=(E, 2, F, D)) / math.sqrt(D)).astype(np.float32),
            (rng.normal(size=(E, D, F)) / math.sqrt(F)).astype(np.float32))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe_mixed"])
def test_moe_layer_matches_transformers(moe_model, name):
    m = moe_model(name)
    i = m.config.moe_layers.index(True)
    layer = m.params.layers[i]
    for b, t in [(1, 1), (2, 9)]:
        x = np.random.default_rng(b * 10 + t).normal(size=(b, t, 64)).astype(np.float32)
        with torch.no_grad():
            want = _hf_sparse_block(m.hf, i)(torch.from_numpy(x)).numpy()
        got = _all_paths(jnp.asarray(x), layer.router, layer.experts_gate_up, layer.experts_down,
                         m.config.experts_per_token, m.config.norm_topk_prob)
        for path, out in got.items():
            assert rel_err(out, want) < 1e-5, (b, t, path)


@pytest.mark.parametrize("E,A,norm", [(8, 2, True), (16, 4, False), (5, 5, True)])
def test_gather_and_ragged_paths_agree(E, A, norm):
    weights = _random_experts(E, 32, 24, seed=E + A)
    for b, t in [(1, 1), (3, 5)]:
        x = np.random.default_rng(b * 100 + t).normal(size=(b, t, 32)).astype(np.float32)
        out = _all_paths(x, *weights, A, norm)
        want = _numpy_moe(x, *weights, A, norm)
        for path in ("gather", "dense", "ragged"):
            assert rel_err(out[path], want) < 1e-5, (b, t, path)
        np.testing.assert_array_equal(out["None"], out[L.moe_path(b * t, A, E, decode=t == 1)])
    with pytest.raises(ValueError, match="unknown MoE path"):
        L.moe(jnp.asarray(x), *weights, A, norm, path="sparse")


def test_path_choice_on_real_shapes():
    # Mixtral-8x7B (E 8, A 2) and Qwen3-30B-A3B (E 128, A 8): decode at small batch gathers the
    # chosen experts, decode at larger batch reads every expert once, prefill always groups.
    assert L.moe_path(1, 2, 8, decode=True) == "gather" and L.moe_path(4, 2, 8) == "gather"
    assert L.moe_path(8, 2, 8, decode=True) == "dense" and L.moe_path(64, 2, 8, decode=True) == "dense"
    assert L.moe_path(8, 2, 8) == "ragged" and L.moe_path(2048, 2, 8) == "ragged"
    assert L.moe_path(256, 2, 8, decode=True) == "ragged"
    assert L.moe_path(16, 8, 128, decode=True) == "gather" and L.moe_path(64, 8, 128) == "ragged"
    assert L.moe_path(64, 8, 128, decode=True) == "dense"
    assert L.moe_path(1, 2, 1) == "ragged"  # one local expert (expert parallel over 8): grouping
    assert L.moe_path(1, 2, 1, decode=True) == "dense"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_gathered_swiglu_in_one_reduction_keeps_the_bits(dtype, monkeypatch):
    """The gather path's gate and up sums as one variadic reduction (SwiGLU made on its sums)
    give the bits of one reduction and a multiply after it, for float and int8 experts."""
    _, gate_up, _ = _random_experts(8, 64, 48, seed=3)
    gate_up = jnp.asarray(gate_up, jnp.float32 if dtype == "float32" else jnp.bfloat16)
    x = jnp.asarray(np.random.default_rng(4).normal(size=(3, 64)), gate_up.dtype)
    if dtype == "int8":
        gate_up = quantize(gate_up)
    experts = jnp.asarray([[0, 5], [7, 2], [3, 3]], jnp.int32)
    outs = {}
    for on in (True, False):
        monkeypatch.setattr(L, "MOE_SWIGLU_REDUCE", on)
        swiglu = jax.jit(lambda *a: L._gathered_swiglu(*a))  # traced afresh: the switch is read then
        # at XLA's own optimization level, not the suite's 0 (conftest): the bits are the optimized code's
        swiglu = swiglu.lower(x, gate_up, experts).compile(compiler_options={"xla_backend_optimization_level": 3})
        outs[on] = np.asarray(swiglu(x, gate_up, experts).astype(jnp.float32))
    assert outs[True].shape == (3, 2, 48) and np.abs(outs[True]).max() > 0
    np.testing.assert_array_equal(outs[True], outs[False])


def test_gather_path_work_does_not_grow_with_experts():
    """A decode step reads and multiplies only its A chosen experts: same FLOPs for 8 or 64 experts."""
    def flops(E):
        fn = jax.jit(partial(L.moe, experts_per_token=2, norm_topk_prob=True, path="gather"))
        cost = fn.lower(jnp.ones((1, 1, 64)), *_random_experts(E, 64, 128, seed=0)).compile()
        cost = cost.cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]
    small, large = flops(8), flops(64)
    per_expert = 2 * 64 * (2 * 128 + 128)  # one token through one expert: gate/up and down
    assert small >= 2 * per_expert
    assert large - small < per_expert  # only the router grows; a dense compute adds 56 experts


# --- real shapes, traced without allocating ---------------------------------------------------

# The published configs as `config_from_hf` reads them (mistralai/Mixtral-8x7B-v0.1,
# Qwen/Qwen3-30B-A3B), with their published parameter counts.
REAL_SHAPES = {
    "mixtral-8x7b": (46.70e9, ModelConfig(
        model_type="mixtral", vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, ffn_size=14336, max_position_embeddings=32768,
        rms_norm_eps=1e-5, rope=RopeConfig(theta=1000000.0), num_experts=8, experts_per_token=2,
        moe_ffn_size=14336, norm_topk_prob=True, moe_layers=(True,) * 32, bos_token_id=1,
        eos_token_ids=(2,))),
    "qwen3-30b-a3b": (30.53e9, ModelConfig(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32,
        num_kv_heads=4, head_dim=128, ffn_size=6144, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope=RopeConfig(theta=1000000.0), qk_norm=True, num_experts=128,
        experts_per_token=8, moe_ffn_size=768, norm_topk_prob=True, moe_layers=(True,) * 48,
        bos_token_id=151643, eos_token_ids=(151645, 151643))),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(REAL_SHAPES))
def test_real_moe_shapes_trace(name):
    """Both paths trace at the real shapes (decode gathers, prefill groups) and the parameter
    count is the published one, all without allocating a weight."""
    count, cfg = REAL_SHAPES[name]
    params = abstract_params(cfg)
    assert abs(sum(x.size for x in jax.tree.leaves(params)) / count - 1) < 1e-3
    def step(params, tokens_BT):
        return jaxllm.model.transformer.step(params, tokens_BT, jaxllm.init_cache(cfg, 1, 1024, params.dtype))
    for shape in [(1, 1), (1, 512)]:
        logits, _ = jax.eval_shape(step, params, jax.ShapeDtypeStruct(shape, jnp.int32))
        assert (logits.shape, logits.dtype) == ((1, cfg.vocab_size), jnp.float32)


# --- whole models ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(moe_model, name):
    m = moe_model(name)
    ids = tokens((2, 12), seed=3)
    with torch.no_grad():
        want = m.hf(torch.from_numpy(ids).long()).logits.numpy()
    assert rel_err(jaxllm.forward(m.params, ids), want) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_cached_decode_equals_full_forward(moe_model, name):
    m = moe_model(name)
    ids = tokens((2, 12), seed=3)
    full = np.asarray(jaxllm.forward(m.params, ids))
    cache = jaxllm.init_cache(m.config, 2, 16, jnp.float32)
    logits, cache = jaxllm.prefill(m.params, ids[:, :8], cache)  # 16+ assignments: grouped
    steps = [logits]
    for t in range(8, 11):  # 2 tokens: qwen3_moe gathers (4 <= 8 / 2), the others group
        logits, cache = jaxllm.decode_step(m.params, ids[:, t], cache)
        steps.append(logits)
    assert rel_err(np.stack(steps, 1), full[:, 7:11]) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_match_transformers_batched_and_alone(moe_model, name):
    """16 greedy tokens equal transformers' for each prompt, generated alone (batch 1: the decode
    step gathers experts) and in a left-padded ragged batch of 3 (the decode step groups them)."""
    m = moe_model(name)
    prompts = [list(tokens((n,), seed=n)) for n in (3, 11, 6)]
    batch = jaxllm.generate(m.params, prompts, max_new_tokens=16, eos_token_ids=())
    np.testing.assert_array_equal(batch.lengths, [16, 16, 16])
    for b, prompt in enumerate(prompts):
        with torch.no_grad():
            want = m.hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                 pad_token_id=0)[0, len(prompt):].numpy()
        alone = jaxllm.generate(m.params, [prompt], max_new_tokens=16, eos_token_ids=())
        np.testing.assert_array_equal(alone.tokens[0], want)
        np.testing.assert_array_equal(batch.tokens[b], want)


# --- expert parallelism ----------------------------------------------------------------------


def _expert_parallel_main():
    """Runs in a subprocess with 8 fake CPU devices: the sharded layer equals the float64 oracle."""
    from jax.sharding import Mesh, PartitionSpec as P
    assert jax.device_count() == 8, jax.devices()
    shapes = [(1, 1), (2, 9)]
    for E, ep, A, norm in [(8, 8, 2, True), (16, 4, 4, False)]:
        mesh = Mesh(np.array(jax.devices()[:ep]), ("expert",))
        weights = _random_experts(E, 32, 24, seed=E * ep)

        def local(xs, router, gate_up, down):
            return [{str(path): L.moe(x, router, gate_up, down, A, norm, path=path,
                                      expert_axis="expert") for path in (None, "gather", "ragged")}
                    for x in xs]
        sharded = jax.jit(jax.shard_map(local, mesh=mesh, out_specs=P(),
                                        in_specs=(P(), P(), P("expert"), P("expert"))))
        xs = [np.random.default_rng(b + t).normal(size=(b, t, 32)).astype(np.float32)
              for b, t in shapes]
        for x, outs in zip(xs, sharded(xs, *weights)):
            want = _numpy_moe(x, *weights, A, norm)
            for path, out in outs.items():
                err = rel_err(out, want)
                assert err < 1e-5, (E, ep, A, x.shape, path, err)
    print("expert parallel ok")


@pytest.mark.slow
def test_expert_parallel_matches_single_device():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "expert parallel ok" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe_mixed"])
def test_batch_1_decode_through_the_kernels_matches_xla(moe_model, monkeypatch, name):
    """A batch-1 decode step of a MoE model: o in project's kernel without its residual, then the
    add with the expert layer's norm in add_norm's kernel, the token routed by route's kernel
    (the experts stay on XLA), and the same add after the expert layer; interpreted, against
    XLA's forms."""
    params = moe_model(name).params
    cfg = params.config
    ids = np.random.default_rng(5).integers(3, cfg.vocab_size, (1, 7)).astype(np.int32)
    rows = spy(monkeypatch, "_add_norm_call", lambda x, *a: x.shape[0])
    routed = spy(monkeypatch, "pick_experts", lambda logits, *a: logits.shape[0])
    runs = decode_per_mode(monkeypatch, params, ids, 4, ["decode_project", "add_norm", "route"])
    assert rel_err(runs[1], runs[0]) < 1e-5
    sparse = sum(cfg.moe_layers)
    # The decode step traced: 2 a MoE layer (a dense one's norms fold into project's kernels).
    assert rows.count(1) == 2 * sparse
    # The prefill's 4 tokens and each decode step's one, routed by the kernel in every MoE layer.
    assert routed.count(4) == routed.count(1) == sparse


@pytest.mark.slow
def test_decode_of_several_rows_keeps_moe_on_xla(moe_model, monkeypatch):
    """`rows_project`'s blocks are for dense models: a MoE decode step of several rows runs XLA's
    forms under the switch, its logits unchanged."""
    params = moe_model("mixtral").params
    ids = np.random.default_rng(6).integers(3, params.config.vocab_size, (2, 7)).astype(np.int32)
    tune(monkeypatch, rows_min=2, rows_large_weights=0)  # as a dense model's two rows would take them
    calls = spy(monkeypatch, "_rows_call")
    runs = decode_per_mode(monkeypatch, params, ids, 4, ["rows_project"])
    assert not calls
    np.testing.assert_array_equal(runs[1], runs[0])


if __name__ == "__main__":
    _expert_parallel_main()
