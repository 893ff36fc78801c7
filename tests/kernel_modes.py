"""Running the model with `jaxllm.kernels` switched: spies on its kernel calls, and decode steps
under each mode of a set of switches, for tests that compare the kernels with XLA's forms."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxllm
from jaxllm import kernels
from jaxllm.model.cache import init_cache


def spy(monkeypatch, name: str, record=lambda *args: 1, module=kernels) -> list:
    """Wrap module.`name` (kernels' by default) so each call (each trace, for jitted callers)
    appends record(*args)."""
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(record(*a)) or real(*a, **k))
    return calls


def prefill_and_decode(params, ids, prompt: int, cache) -> list:
    """Prefill ids[:, :prompt] into cache, then decode the rest one token a step: [the prefill's
    logits, then each step's] as numpy arrays [B, V]."""
    logits, cache = jaxllm.prefill(params, ids[:, :prompt], cache)
    steps = [np.asarray(logits)]
    for t in range(prompt, ids.shape[1]):
        logits, cache = jaxllm.decode_step(params, ids[:, t], cache)
        steps.append(np.asarray(logits))
    return steps


def decode_per_mode(monkeypatch, params, ids, prompt: int, switches, modes=("xla", "interpret")):
    """Prefill ids[:, :prompt] into a float32 cache of 16 slots, then decode the rest one token a
    step, with every kernel switch in `switches` set to each mode in turn (jit caches cleared
    around each): [logits [steps, B, V] per mode]."""
    runs = []
    for mode in modes:
        jax.clear_caches()
        for switch in switches:
            monkeypatch.setattr(kernels, switch, mode)
        cache = init_cache(params.config, ids.shape[0], 16, jnp.float32)
        runs.append(np.stack(prefill_and_decode(params, ids, prompt, cache)[1:]))
    jax.clear_caches()
    return runs
