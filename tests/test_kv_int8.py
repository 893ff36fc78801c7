"""The int8 KV cache (`kv_dtype="int8"`): per-slot scales, close to the float cache, half the bytes."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxllm
from jaxllm.engine import memory
from jaxllm.layers import dense as L
from jaxllm.model.cache import cache_bytes, init_cache
from tiny_models import random_tokens, rel_err

gen = importlib.import_module("jaxllm.engine.generate")  # the module; `jaxllm.generate` is the function


def test_quantize_kv_round_trip_within_half_a_step():
    x = jax.random.normal(jax.random.key(0), (2, 3, 5, 16), jnp.float32) * 3.0
    x = x.at[0, 0, 0].set(0.0)  # an all-zero slot must come back exactly zero
    q, scale = L.quantize_kv(x)
    assert q.dtype == jnp.int8 and scale.shape == (2, 3, 5)
    err = jnp.abs(q.astype(jnp.float32) * scale[..., None] - x)
    assert bool(jnp.all(err <= scale[..., None] / 2 + 1e-6))
    assert bool(jnp.all(q[0, 0, 0] == 0))


@pytest.mark.slow
def test_int8_cache_decode_is_close_to_the_full_forward(tiny):
    m = tiny("llama")
    ids = random_tokens((2, 14))
    full = np.asarray(jaxllm.forward(m.params, ids))
    cache = init_cache(m.params.config, 2, 32, jnp.float32, kv_dtype="int8")
    logits, cache = jaxllm.prefill(m.params, ids[:, :10], cache)
    steps = [np.asarray(logits)]
    for t in range(10, 14):
        logits, cache = jaxllm.decode_step(m.params, ids[:, t], cache)
        steps.append(np.asarray(logits))
    assert cache.k[0].dtype == jnp.int8 and cache.k_scale[0].shape == (2, m.params.config.num_kv_heads, 32)
    # Every leaf its own buffer: decode_step donates the cache on GPUs, and a buffer cannot go twice.
    fresh = jax.tree.leaves(init_cache(m.params.config, 2, 32, jnp.float32, kv_dtype="int8"))
    assert len({id(x) for x in fresh}) == len(fresh)
    err = rel_err(np.stack(steps, 1), full[:, 9:14])
    # 8-bit rounding of k and v (each within 1/254 of its slot's largest entry): measured 2.8e-2 on
    # this model, whose redrawn weights spread the logits wide; the float cache stays within 1e-5.
    assert 1e-5 < err < 6e-2


@pytest.mark.slow
def test_default_model_answers_the_same_with_an_int8_cache():
    params, tok = jaxllm.load(dtype="float32"), jaxllm.load_tokenizer()
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    out = jaxllm.generate(params, [ids], max_new_tokens=16, kv_dtype="int8")
    text = tok.decode(np.asarray(out.tokens)[0, :int(out.lengths[0])], skip_special_tokens=True)
    assert "Paris" in text


@pytest.mark.slow
def test_int8_cache_bytes_and_the_memory_check(monkeypatch, tiny):
    params = tiny("llama").params
    cfg = params.config
    H = cfg.head_dim
    assert cache_bytes(cfg, 2, 64, jnp.float32, "int8") * 4 * H == cache_bytes(cfg, 2, 64, jnp.float32) * (H + 4)
    # Free memory that holds the int8 cache but not the float32 one: only the float request fails.
    B, T, S = 4, 16, 16 + 16
    act = memory.activation_bytes(cfg, B, T, S, jnp.float32, fresh=True)
    free = act + (cache_bytes(cfg, B, S, jnp.float32, "int8") + cache_bytes(cfg, B, S, jnp.float32)) // 2
    monkeypatch.setattr(memory, "memory_stats", lambda device: {"bytes_limit": 10 ** 12,
                                                                "bytes_in_use": 10 ** 12 - free})
    ids = np.full((B, T), 5, np.int32)
    with pytest.raises(ValueError, match="out of device memory"):
        jaxllm.generate(params, ids, max_new_tokens=16)
    assert jaxllm.generate(params, ids, max_new_tokens=16, kv_dtype="int8").tokens.shape == (B, 16)


def test_bad_kv_dtype_and_sharded_params_are_refused(tiny):
    params = tiny("llama").params
    with pytest.raises(ValueError, match="unsupported kv_dtype 'bf16'"):
        jaxllm.generate(params, [[5, 6]], kv_dtype="bf16")
    with pytest.raises(ValueError, match="int8 KV cache with tensor-parallel"):
        jaxllm.generate(params.replace(tp=object()), [[5, 6]], kv_dtype="int8")
