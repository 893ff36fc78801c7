"""The memory-fit check before generate allocates: a request that cannot fit fails at once with
both figures and what would fit; one that fits runs. Device statistics are faked (the CPU has none)."""

from __future__ import annotations

import importlib
import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxllm
from jaxllm.engine import memory
from jaxllm.model.cache import cache_bytes
from jaxllm.model.params import abstract_params, init_params, param_bytes
from jaxllm.tools import presets
from compile_counting import compilations

gen = importlib.import_module("jaxllm.engine.generate")  # the module; `jaxllm.generate` is the function


@pytest.fixture(scope="module")
def params():
    return init_params(presets.PRESETS["tiny"], jax.random.key(0), jnp.float32)


def fake_free(monkeypatch, free: int, limit: int = 10 ** 12):
    monkeypatch.setattr(memory, "memory_stats",
                        lambda device: {"bytes_limit": limit, "bytes_in_use": limit - free})


def test_a_request_over_free_memory_fails_before_anything_runs(monkeypatch, params):
    cfg = params.config
    B, T, length = 8, 16, 16 + 512  # prompts of 16 tokens, 500 new ones: 512 decode slots
    kv = cache_bytes(cfg, B, length, jnp.float32)
    act = memory.activation_bytes(cfg, B, T, length, jnp.float32, fresh=True)
    free = (kv + act) * 3 // 4
    fake_free(monkeypatch, free)
    monkeypatch.setattr(gen, "_generate_core", lambda *a, **k: pytest.fail("generate ran"))
    ids = np.full((B, T), 5, np.int32)
    with pytest.raises(ValueError, match="out of device memory") as e:
        jaxllm.generate(params, ids, max_new_tokens=500)
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


@pytest.mark.slow
def test_a_request_that_fits_runs(monkeypatch, params):
    fake_free(monkeypatch, 10 ** 9)
    out = jaxllm.generate(params, np.full((2, 5), 7, np.int32), max_new_tokens=4, eos_token_ids=[])
    assert np.asarray(out.lengths).tolist() == [4, 4]


@pytest.mark.slow
def test_generate_weighs_xla_count_of_its_program_where_the_bound_fits(monkeypatch, params):
    # The bound is an estimate (int8 and MoE prefills held several times it on an H200): where it
    # says the request fits, generate compiles its program and checks XLA's own count as well.
    cfg = params.config
    B, T, length = 4, 16, 16 + 64
    kv = cache_bytes(cfg, B, length, jnp.float32)
    act = memory.activation_bytes(cfg, B, T, length, jnp.float32, fresh=True)
    fake_free(monkeypatch, kv + act + 1000)
    monkeypatch.setattr(gen, "_ALLOCATED", {})
    counted, real = [], memory.program_bytes

    def over_the_bound(compiled):  # XLA's real count of the compiled program, then one the bound misses
        counted.append(real(compiled))
        return kv + 2 * act
    monkeypatch.setattr(memory, "program_bytes", over_the_bound)
    ids = np.full((B, T), 5, np.int32)
    with pytest.raises(ValueError, match="out of device memory") as e:
        jaxllm.generate(params, ids, max_new_tokens=60)
    assert counted and counted[0] > kv  # the program that would have run, its cache inside
    msg = str(e.value)
    assert f"{memory.size_text(2 * act)} of activations by XLA's count" in msg, msg
    assert memory.size_text(kv + 2 * act) in msg, msg
    rows = int(re.search(r"batch (\d+) at this length", msg).group(1))
    assert 0 < rows < B  # the offer scaled to XLA's count: the bound alone fits all B rows
    # The count is kept per program: asked again, the program is not traced again.
    with pytest.raises(ValueError, match="by XLA's count"):
        jaxllm.generate(params, ids, max_new_tokens=60)
    assert len(counted) == 1
    # Where XLA's count fits too, it runs; without statistics nothing is compiled for the check.
    gen._ALLOCATED.clear()
    monkeypatch.setattr(memory, "program_bytes", lambda compiled: kv + act)
    out = jaxllm.generate(params, ids, max_new_tokens=60, eos_token_ids=[])
    assert np.asarray(out.lengths).tolist() == [60] * B
    gen._ALLOCATED.clear()
    monkeypatch.setattr(memory, "memory_stats", lambda device: None)
    monkeypatch.setattr(memory, "program_bytes", lambda compiled: pytest.fail("compiled to check"))
    jaxllm.generate(params, ids, max_new_tokens=60, eos_token_ids=[])


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
        # A prefill into the empty cache scores only the prompt against itself: a 1024-token one
        # costs a row's worth of its activations, 6 rows. A 32768-token prompt, where the masked
        # XLA form's float32 scores and bf16 probabilities are 206 GB a row, fits only with the
        # fused (cuDNN) attention, which never forms them; then the MLP's [T, 2F] float32
        # intermediates, as XLA keeps them, leave room for 2 rows.
        assert offer(8, 1024, 131072) == 6
        mp.setattr(memory, "uses_cudnn_attention", lambda dtype, head_dim: False)
        assert offer(8, 32768, 131072) == 0
        mp.setattr(memory, "uses_cudnn_attention", lambda dtype, head_dim: True)
        assert offer(8, 32768, 131072) == 2
        memory.check_fit(params, 1, 32768, 131072)


def test_activation_bound_covers_what_the_h200_held():
    """The 8B shape's long prefills on an H200 (bf16, cuDNN attention, device run of 2026-11-29):
    8 x 8192 tokens held 50.0 GB beside weights and cache; 16 x 8192 asked XLA for 83.8 GB of
    temporaries and ran out of memory although the one-layer count said 44.6 GB."""
    cfg = presets.PRESETS["llama3-8b"]
    act = partial(memory.activation_bytes, cfg, tokens=8192, length=8448, dtype=jnp.bfloat16,
                  fresh=True, flash=True)
    assert act(batch=8) >= 50.0e9 and act(batch=16) >= 83.8e9


def test_without_statistics_nothing_is_checked(monkeypatch, params):
    monkeypatch.setattr(memory, "memory_stats", lambda device: None)
    memory.check_fit(params, 10 ** 6, 16, 10 ** 6)


def test_on_the_cpu_the_hosts_memory_is_what_is_free(monkeypatch, params, tmp_path):
    """The CPU backend keeps no statistics; the host's MemTotal and MemAvailable stand in, so a
    request larger than the machine fails at once instead of swapping or hanging."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:        4096 kB\nMemFree:           10 kB\nMemAvailable:    1024 kB\n")
    assert memory.host_memory_stats(str(meminfo)) == {"bytes_limit": 4096 * 1024, "bytes_in_use": 3072 * 1024}
    assert memory.host_memory_stats(str(tmp_path / "absent")) is None
    (tmp_path / "odd").write_text("MemTotal: lots\n")
    assert memory.host_memory_stats(str(tmp_path / "odd")) is None
    real = memory.host_memory_stats
    monkeypatch.setattr(memory, "host_memory_stats", lambda: real(str(meminfo)))
    monkeypatch.setattr(gen, "_generate_core", lambda *a, **k: pytest.fail("generate ran"))
    assert jax.devices()[0].platform == "cpu"
    with pytest.raises(ValueError, match="out of device memory") as e:
        jaxllm.generate(params, np.full((8, 16), 5, np.int32), max_new_tokens=500)
    assert "only 1.05 MB of its 4.19 MB are free" in str(e.value), str(e.value)


def test_forward_counts_the_logits_it_returns(monkeypatch, params):
    """forward's [B, T, V] float32 logits can outweigh everything else: a request whose logits
    alone exceed what is free fails before anything runs."""
    cfg = params.config
    B, T = 4, 64
    logits = B * T * cfg.vocab_size * 4
    kv, act = memory.request_bytes(params, B, T, T)
    assert memory.request_bytes(params, B, T, T, all_logits=True) == (kv, act + logits)
    fake_free(monkeypatch, kv + act + logits // 2)
    monkeypatch.setattr(jaxllm.engine.steps, "_forward", lambda *a: pytest.fail("forward ran"))
    with pytest.raises(ValueError, match="out of device memory"):
        jaxllm.forward(params, np.full((B, T), 5, np.int32))
    monkeypatch.undo()  # forward itself back; and room for the logits too
    fake_free(monkeypatch, kv + act + logits + 1000)
    assert jaxllm.forward(params, np.full((B, T), 5, np.int32)).shape == (B, T, cfg.vocab_size)


@pytest.mark.slow
def test_stream_weighs_xla_count_of_its_prefill_and_compiles_it_once(monkeypatch, params):
    # stream's cache is an argument of its steps: XLA's count of the prefill step comes on top of
    # it. The step compiled for the count is the one the stream then runs.
    cfg = params.config
    T, new = 16, 60
    length = T + gen.bucket(new)
    kv = cache_bytes(cfg, 1, length, jnp.float32)
    act = memory.activation_bytes(cfg, 1, T, length, jnp.float32, fresh=True)
    fake_free(monkeypatch, kv + act + 1000)
    monkeypatch.setattr(gen, "_ALLOCATED", {})
    counted, real = [], memory.program_bytes
    monkeypatch.setattr(memory, "program_bytes", lambda compiled: counted.append(real(compiled)) or 2 * act)
    ids = [5] * T
    with pytest.raises(ValueError, match="out of device memory") as e:
        next(jaxllm.stream(params, ids, max_new_tokens=new))
    assert f"{memory.size_text(2 * act)} of activations by XLA's count" in str(e.value)
    assert len(counted) == 1 and counted[0] > 0
    gen._ALLOCATED.clear()
    monkeypatch.setattr(memory, "program_bytes", lambda compiled: act)
    with compilations() as names:
        out = list(jaxllm.stream(params, ids, max_new_tokens=3, eos_token_ids=[]))
    assert len(out) == 3
    assert names.count("jit(step)") == 2, names  # the prefill (once, for the count and the run), a step
