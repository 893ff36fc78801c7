"""The memory-fit check before generate allocates: a request that cannot fit fails at once with
both figures and what would fit; one that fits runs. Device statistics are faked (the CPU has none)."""

from __future__ import annotations

import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxllm
from jaxllm import memory, presets
from jaxllm.cache import cache_bytes
from jaxllm.params import abstract_params, init_params, param_bytes

gen = importlib.import_module("jaxllm.generate")  # the module; `jaxllm.generate` is the function


@pytest.fixture(scope="module")
def params():
    return init_params(presets.PRESETS["tiny"], jax.random.key(0), jnp.float32)


def fake_free(monkeypatch, free: int, limit: int = 10 ** 12):
    monkeypatch.setattr(memory, "memory_stats",
                        lambda device: {"bytes_limit": limit, "bytes_in_use": limit - free})


def test_a_request_over_free_memory_fails_before_anything_runs(monkeypatch, params):
    cfg = params.config
    B, T, length = 8, 16, 16 + 64  # prompts of 16 tokens, 48 new ones: 64 decode slots
    kv = cache_bytes(cfg, B, length, jnp.float32)
    act = memory.activation_bytes(cfg, B, T, length, jnp.float32)
    free = (kv + act) * 3 // 4
    fake_free(monkeypatch, free)
    monkeypatch.setattr(gen, "_generate_core", lambda *a, **k: pytest.fail("generate ran"))
    ids = np.full((B, T), 5, np.int32)
    with pytest.raises(ValueError, match="out of device memory") as e:
        jaxllm.generate(params, ids, max_new_tokens=48)
    msg = str(e.value)
    for figure in (kv + act, kv, act, free, param_bytes(params)):
        assert memory.size_text(figure) in msg, (memory.size_text(figure), msg)
    # What it offers fits, and one more does not.
    rows = int(re.search(r"batch (\d+) at this length", msg).group(1))
    slots = int(re.search(r"(\d+) cache slots \(prompt", msg).group(1))
    assert 0 < rows < B and T <= slots < length
    memory.check_fit(params, rows, T, length)
    memory.check_fit(params, B, T, slots)
    with pytest.raises(ValueError):
        memory.check_fit(params, rows + 1, T, length)
    with pytest.raises(ValueError):
        memory.check_fit(params, B, T, slots + 1)
    fake_free(monkeypatch, 10 ** 4)  # not even one row
    with pytest.raises(ValueError, match="out of device memory"):  # stream plans the same way
        next(jaxllm.stream(params, list(ids[0]), max_new_tokens=48))


def test_a_request_that_fits_runs(monkeypatch, params):
    fake_free(monkeypatch, 10 ** 9)
    out = jaxllm.generate(params, np.full((2, 5), 7, np.int32), max_new_tokens=4, eos_token_ids=[])
    assert np.asarray(out.lengths).tolist() == [4, 4]


def test_llama3_8b_context_that_cannot_fit_names_what_can():
    """The 8B shape in bf16 on a 141 GB device that holds its 16 GB of weights: the full 128k context
    at batch 8 needs 137 GB of KV cache alone. Shapes only: nothing is allocated."""
    cfg = presets.PRESETS["llama3-8b"]
    params = abstract_params(cfg, jnp.bfloat16)
    weights = param_bytes(params)
    stats = {"bytes_limit": 141 * 10 ** 9, "bytes_in_use": weights}

    def offer(batch, prompt, length):
        with pytest.raises(ValueError, match="out of device memory") as e:
            memory.check_fit(params, batch, prompt, length)
        msg = str(e.value)
        assert "KV cache 137.44 GB" in msg and f"{memory.size_text(weights)} of weights" in msg, msg
        return int(re.search(r"batch (\d+) at this length", msg).group(1))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(memory, "memory_stats", lambda device: stats)
        assert offer(8, 16, 131072) == 7  # 17.2 GB of cache per row in the 124.9 GB left
        # A 1024-token prefill scores every slot of the cache: 26 GB of float32 scores and their
        # bf16 probabilities per row, so only 2 rows fit.
        assert offer(8, 1024, 131072) == 2
        memory.check_fit(params, 1, 1024, 131072)


def test_without_statistics_nothing_is_checked(monkeypatch, params):
    monkeypatch.setattr(memory, "memory_stats", lambda device: None)
    memory.check_fit(params, 10 ** 6, 16, 10 ** 6)
