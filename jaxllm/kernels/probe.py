"""Whether each kernel family compiles on this device. A backend that imports may still fail to
lower or compile a kernel (a JAX or Triton release the kernels were not written for): the step
plan asks `compiles` before it picks a family, and a family that fails takes XLA's form, with one
warning line naming it and the reason (`runtime.fall_back`), instead of failing the first step.

Each family is compiled once a process, at a small shape, from abstract arguments (nothing is
allocated or run)."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp

from jaxllm import runtime
from jaxllm.kernels.add_norm import add_norm
from jaxllm.kernels.decode_attention import decode_attention, verify_attention
from jaxllm.kernels.project import _project_kernel_call, project
from jaxllm.kernels.route import route
from jaxllm.kernels.rows_project import rows_project
from jaxllm.kernels.tuning import KernelTuning
from jaxllm.layers.quant import quantize

_D, _F, _H = 256, 512, 64  # small, but within every family's tiles on a GPU
_results: dict[tuple, bool] = {}
_lock = threading.RLock()
_probing = threading.local()


def probing() -> bool:
    """Whether this thread is compiling a probe now (tests that count kernel calls skip those)."""
    return getattr(_probing, "on", False)


def _spec(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def _compile(fn, *specs) -> None:
    jax.jit(fn).lower(*specs).compile()


def _attention(kernel, mode: str, t: KernelTuning, tokens: int, head_dim: int = _H, q_per_kv: int = 2,
               qk_norm: bool = False, **switches) -> None:
    """`kernel` (decode or verify attention) at the model's head size, group and score switches
    (scale, soft cap, norm offset): what a step compiles, at 2 rows of 256 slots."""
    B, K, G, S, H = 2, 2, q_per_kv, 256, head_dim
    qkv = _spec((B, K, G + 2, H) if tokens == 1 else (B, tokens, K, G + 2, H))
    norms = (_spec((H,)), _spec((H,))) if qk_norm else ()

    def run(qkv, k, v, end, start, rot, *norm):
        q_norm, k_norm = norm or (None, None)
        return kernel(qkv, k, v, end, start, rot, q_norm_H=q_norm, k_norm_H=k_norm,
                      interpret=mode == "interpret", tuning=t, **switches)
    _compile(run, qkv, _spec((B, K, S, H)), _spec((B, K, S, H)), _spec((B,), jnp.int32),
             _spec((B,), jnp.int32), _spec((S, 2, H // 2), jnp.float32), *norms)


def _decode_attention(mode: str, t: KernelTuning, **variant) -> None:
    _attention(decode_attention, mode, t, 1, **variant)


def _verify_attention(mode: str, t: KernelTuning, **variant) -> None:
    _attention(verify_attention, mode, t, 4, **variant)


def _project(mode: str, t: KernelTuning) -> None:
    def run(x, w, gate_up, norm):
        plain = project(x, w, norm_C=norm, mode=mode, tuning=t)
        int8 = project(x, quantize(w), mode=mode, tuning=t)
        return plain, int8, project(x, gate_up, swiglu=True, mode=mode, tuning=t)
    _compile(run, _spec((1, _D)), _spec((_F, _D)), _spec((2, _F, _D)), _spec((_D,)))


def _l2_prefetch(mode: str, t: KernelTuning) -> None:
    """`project` asking L2 for a later matrix, bulk and a line at a time."""
    def run(x, w, later):
        return [_project_kernel_call(x, w, None, None, None, (later,), eps=1e-6, swiglu=False,
                                     out_dtype=jnp.dtype(jnp.bfloat16), rows=2, chunk=_D, warps=4,
                                     interpret=mode == "interpret", lines=lines)
                for lines in (False, True)]
    _compile(run, _spec((1, _D)), _spec((_F, _D)), _spec((_F, _D)))


def _rows_project(mode: str, t: KernelTuning) -> None:
    _compile(lambda x, w: rows_project(x, w, mode=mode, tuning=t), _spec((t.rows_min, _D)), _spec((_F, _D)))


def _add_norm(mode: str, t: KernelTuning) -> None:
    _compile(lambda x, d, n: add_norm(x, d, n, 1e-6, mode=mode, tuning=t),
             _spec((1, _D)), _spec((1, _D)), _spec((_D,)))


def _route(mode: str, t: KernelTuning) -> None:
    _compile(lambda x, r: route(x, r, 2, True, mode=mode, tuning=t), _spec((4, _D)), _spec((8, _D)))


PROBES = {"decode_attention": _decode_attention, "verify_attention": _verify_attention, "project": _project, "rows_project": _rows_project,
          "add_norm": _add_norm, "route": _route, "l2_prefetch": _l2_prefetch}
# What a family that does not compile does instead, where that is not XLA's form.
INSTEAD = {"l2_prefetch": "is left out (the projections ask L2 for nothing)"}


def compiles(family: str, mode: str | None, tuning: KernelTuning, **variant) -> str | None:
    """`mode` where kernel `family` compiles here under it (tried once a process for each
    `variant`: the attention's head size, group and score switches), else None."""
    if mode is None:
        return None
    key = (family, mode, tuning, tuple(sorted(variant.items())))
    with _lock:  # the plan may be made on several threads (an engine's, a caller's)
        if key not in _results:
            _probing.on = True
            try:
                PROBES[family](mode, tuning, **variant)
                _results[key] = True
            except Exception as e:  # whatever a lowering or a compiler raises
                reason = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                runtime.fall_back(family, f"its kernel does not compile here ({reason})",
                                  *[INSTEAD[family]] if family in INSTEAD else [])
                _results[key] = False
            finally:
                _probing.on = False
    return mode if _results[key] else None
