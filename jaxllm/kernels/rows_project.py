"""Decode steps of 8-32 rows: each matrix as a tensor-core kernel that adds the bias and the
residual to its output tile and takes SwiGLU's gate and up as two operands of one program, where
XLA ran those as fusions of their own (docs/decisions/rows-project.md). The norm stays XLA's."""

import functools

import jax
import jax.numpy as jnp

from jaxllm import runtime
from jaxllm.kernels.common import pl, plt, dot_t, launch_dependents, pdl_trigger, pow2, swiglu as _swiglu
from jaxllm.kernels.project import project_xla
from jaxllm.kernels.tuning import KernelTuning, current
from jaxllm.layers import dense as L
from jaxllm.layers.quant import QuantizedWeight


def rows_tiles(width: int, C: int, tuning: KernelTuning | None = None):
    """(outputs, chunk, warps, stages) of `_rows_call` for `width` outputs and C channels, or None
    where none divide them. 64 outputs a program where that gives at least 2/3 of the
    multiprocessors' programs (the 8B shape's qkv, 96; gate/up, 224), else 32 (its o and down,
    128); chunks of 8192 / outputs channels (16 KB of weights a stage in bf16), halved until they
    divide C (docs/decisions/rows-project.md#tiles-per-matrix)."""
    outputs, chunk, warps, stages = (tuning or current()).rows_tiles
    if not outputs:
        outputs = next((n for n in (64, 32, 16) if width % n == 0 and 3 * (width // n)
                        >= 2 * runtime.multiprocessors()), 16 if width % 16 == 0 else 0)
        chunk = 8192 // max(outputs, 1)
        while chunk > 16 and C % chunk:
            chunk //= 2
    if not outputs or width % outputs or C % chunk:
        return None
    return outputs, chunk, warps, stages


def supports(w_NC, swiglu: bool = False, tuning: KernelTuning | None = None) -> bool:
    """Whether the kernel takes a float w [N, C] (gate/up [2, F, C]): not int8, and `rows_tiles`
    divide it."""
    return _tiles_of(w_NC, swiglu, tuning) is not None


def _tiles_of(w_NC, swiglu: bool, tuning: KernelTuning | None):
    if isinstance(w_NC, QuantizedWeight):
        return None
    return rows_tiles(w_NC.shape[1] if swiglu else w_NC.shape[0], w_NC.shape[-1], tuning)


def rows_project(x_MC, w_NC, *, norm_C=None, eps: float = 1e-6, bias_N=None, residual_MN=None,
                 swiglu: bool = False, activation: str = "silu", mode: str | None = None,
                 tuning: KernelTuning | None = None):
    """`project` for a decode step's rows: [residual +] (rms_norm(x) if norm else x) @ w.T
    [+ bias], or with `swiglu` act(gate) * up (act silu, or `activation` as `project`'s); the
    product and its epilogue in one kernel under
    `mode` where `supports` w and x has at most `rows_max` rows, else XLA's form. The norm is
    always XLA's, before the kernel."""
    t = tuning or current()
    tiles = None if mode is None else _tiles_of(w_NC, swiglu, t)
    if tiles is None or x_MC.shape[0] > t.rows_max:
        return project_xla(x_MC, w_NC, norm_C, eps, bias_N, residual_MN, swiglu, x_MC.dtype, activation)
    if norm_C is not None:
        x_MC = L.rms_norm(x_MC, norm_C, eps)
    return _rows_call(x_MC, w_NC, bias_N, residual_MN, swiglu=swiglu, activation=activation,
                      tiles=tiles, interpret=mode == "interpret", tuning=t)


def _rows_padded(M: int) -> int:
    """x's M rows as `_rows_kernel` pads them: a power of two, at least 16 (the tensor core's
    fewest), the padding masked."""
    return max(16, pow2(M))


@functools.partial(jax.jit, static_argnames=("swiglu", "activation", "tiles", "interpret", "tuning"))
def _rows_call(x_MC, w_NC, bias_N=None, residual_MN=None, *, swiglu, tiles, interpret,
               tuning: KernelTuning, activation: str = "silu"):
    """The pallas_call of `rows_project`: one program per `outputs` columns of the output, its
    weights streamed in chunks of C (a loop Triton pipelines)."""
    outputs, chunk, warps, stages = tiles
    M, C = x_MC.shape
    P = _rows_padded(M)
    width = w_NC.shape[1] if swiglu else w_NC.shape[0]
    specs, args = [pl.BlockSpec((M, C), lambda j: (0, 0))], [x_MC]
    if swiglu:
        specs += [pl.BlockSpec((None, outputs, C), lambda j, p=p: (p, j, 0)) for p in (0, 1)]
        args += [w_NC, w_NC]
    else:
        specs.append(pl.BlockSpec((outputs, C), lambda j: (j, 0)))
        args.append(w_NC)
    columns = pl.BlockSpec((M, outputs), lambda j: (0, j))
    if bias_N is not None:
        specs.append(pl.BlockSpec((outputs,), lambda j: (j,)))
        args.append(bias_N)
    if residual_MN is not None:
        specs.append(columns)
        args.append(residual_MN)
    kernel = functools.partial(
        _rows_kernel, M=M, chunk=chunk, swiglu=swiglu, activation=activation, biased=bias_N is not None,
        residual=residual_MN is not None,
        trigger=pdl_trigger(interpret, tuning) and P >= tuning.rows_signal_rows)
    return pl.pallas_call(
        kernel, grid=(width // outputs,), in_specs=specs, out_specs=columns,
        out_shape=jax.ShapeDtypeStruct((M, width), x_MC.dtype),
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret, name="decode_rows_project")(*args)


def _rows_kernel(x_ref, *refs, M, chunk, swiglu, biased, residual, trigger, activation="silu"):
    """One program of `_rows_call`: its outputs' sums over the chunks of C, each a tensor-core
    dot of x's rows (padded to P >= 16, the padding masked) with the chunk of weights."""
    refs = list(refs)
    take = lambda: refs.pop(0)
    w_refs = [take() for _ in range(2 if swiglu else 1)]
    b_ref = take() if biased else None
    r_ref = take() if residual else None
    (o_ref,) = refs
    P, C = _rows_padded(M), x_ref.shape[1]
    program = launch_dependents(pl.program_id(0)) if trigger else 0
    real = (jnp.arange(P) < M)[:, None]
    rows_of = jnp.broadcast_to(real, (P, chunk))

    def step(k, sums):
        at = pl.multiple_of(k * chunk, chunk)
        x = plt.load(x_ref.at[pl.ds(0, P), pl.ds(at, chunk)], mask=rows_of, other=0)
        return tuple(acc + dot_t(x, w_ref[:, pl.ds(at, chunk)]) for acc, w_ref in zip(sums, w_refs))

    zeros = jnp.zeros((P, w_refs[0].shape[0]), jnp.float32)
    sums = jax.lax.fori_loop(0, C // chunk, step, (zeros,) * len(w_refs))
    y = (_swiglu(*sums, x_ref.dtype, activation) if swiglu else sums[0]).astype(o_ref.dtype)
    if biased:
        y = y + b_ref[...].astype(o_ref.dtype)[None, :]
    if residual:
        y = plt.load(r_ref.at[pl.ds(0, P), :], mask=real, other=0).astype(o_ref.dtype) + y
    if trigger:  # the signal's result used, so that the compiler keeps it
        y = jnp.where(program >= 0, y, 0).astype(o_ref.dtype)
    plt.store(o_ref.at[pl.ds(0, P), :], y, mask=real)

