"""Running the model with `jaxllm.kernels` switched: a `KernelTuning` with some knobs changed, spies
on its kernel calls, and decode steps under each mode of a set of switches, for tests that compare
the kernels with XLA's forms."""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxllm
from jaxllm.kernels import probe
from jaxllm.kernels import tuning as tuning_module
from jaxllm.model.cache import init_cache

# The kernel families' modules (the package's attributes of the same names are their functions).
FAMILIES = [sys.modules[f"jaxllm.kernels.{name}"] for name in
            ("project", "digits", "add_norm", "rows_project", "route", "decode_attention", "common")]


# The custom call a Pallas Triton kernel lowers to for CUDA: XLA's own Triton call up to jaxlib
# 0.10.2, jaxlib's FFI handler after (jax/_src/pallas/triton/pallas_call_registration.py).
TRITON_CALLS = ("__gpu$xla.gpu.triton", "triton_kernel_call_ffi")


def calls_triton(lowered_text: str) -> bool:
    """Whether a program lowered for CUDA calls a Pallas Triton kernel, in either JAX's form."""
    return any(f"custom_call @{target}(" in lowered_text for target in TRITON_CALLS)


def tuning() -> tuning_module.KernelTuning:
    """The process's kernel tuning, as the step plan reads it."""
    return tuning_module.current()


def tune(monkeypatch, **fields):
    """Run with the process's `KernelTuning` changed in `fields` (jit caches cleared, as kernels
    called without a tuning read it while traced)."""
    monkeypatch.setattr(tuning_module, "TUNING", dataclasses.replace(tuning_module.TUNING, **fields))
    jax.clear_caches()


def spy(monkeypatch, name: str, record=lambda *args: 1, module=None) -> list:
    """Wrap module.`name` (by default the kernel family's module that defines it) so each call
    (each trace, for jitted callers) appends record(*args); not the calls of the step plan's
    compile probes (`jaxllm.kernels.probe`)."""
    if module is None:
        module = next(m for m in FAMILIES if name in vars(m))
        name = "digits_call" if name == "_digits_call" else name  # the name project.py calls
    calls, real = [], getattr(module, name)

    def wrapped(*a, **k):
        if not probe.probing():
            calls.append(record(*a))
        return real(*a, **k)
    monkeypatch.setattr(module, name, wrapped)
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
    step, with every kernel switch (a `KernelTuning` field) in `switches` set to each mode in turn
    (jit caches cleared around each): [logits [steps, B, V] per mode]."""
    runs = []
    for mode in modes:
        tune(monkeypatch, **dict.fromkeys(switches, mode))
        cache = init_cache(params.config, ids.shape[0], 16, jnp.float32)
        runs.append(np.stack(prefill_and_decode(params, ids, prompt, cache)[1:]))
    jax.clear_caches()
    return runs
