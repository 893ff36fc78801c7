"""Residual add and RMSNorm in one pass: the residual stream and the next block's normed input,
where XLA ran the add, the norm's reduction and its multiply as passes of their own
(docs/decisions/add-norm.md). Optionally writes the normed row's int8 digits (`digits.DigitRow`).
Pallas on Triton, or on Mosaic GPU where the tuning's `add_norm_backend` asks for it
(docs/decisions/kernel-backends.md)."""

import functools

import jax
import jax.numpy as jnp

from jaxllm import runtime
from jaxllm.kernels import common
from jaxllm.kernels.common import pl, plgpu, plt, launch_dependents, mosaic_interpret, pdl_trigger, pow2
from jaxllm.kernels.digits import DIGIT_ROWS, DigitRow, store_digits
from jaxllm.kernels.tuning import KernelTuning, current
from jaxllm.layers import dense as L


def supports(rows: int, digits: bool = False) -> bool:
    """The kernel's hard limits: any rows and width; the normed row's digits for one row only."""
    return rows >= 1 and (rows == 1 or not digits)


def add_norm(x_MC, delta_MC, norm_C, eps: float, *, offset: float = 0.0, delta_norm_C=None,
             mode: str | None = None, digits: bool = False, tuning: KernelTuning | None = None):
    """(x + delta, rms_norm(x + delta) with weight norm): the residual stream and the next
    block's normed input, in one kernel per row when `mode` is "gpu" or "interpret", else XLA.
    With `digits` (one row, a kernel's mode) the normed row comes as a `DigitRow`, for
    `project`'s tensor-core kernel. Gemma's: norms of scale (offset + w) (`layers.rms_norm`'s
    offset), and with `delta_norm_C` delta normed by it before the add (a post-norm)."""
    if mode is None:
        if delta_norm_C is not None:
            delta_MC = L.rms_norm(delta_MC, delta_norm_C, eps, offset)
        sum_MC = x_MC + delta_MC
        return sum_MC, L.rms_norm(sum_MC, norm_C, eps, offset)
    digits = digits and x_MC.shape[0] == 1
    t = tuning or current()
    delta_MC = delta_MC.astype(x_MC.dtype)
    norms = [norm_C] + ([] if delta_norm_C is None else [delta_norm_C])
    if t.add_norm_backend == "mosaic_gpu" and mosaic_supports(x_MC.shape[1], digits, x_MC.dtype, *norms):
        return _mosaic_add_norm_call(x_MC, delta_MC, norm_C, delta_norm_C, eps=eps, offset=offset,
                                     interpret=mode == "interpret", tuning=t)
    if common.TRITON_MISSING is not None:  # a call the Mosaic GPU form does not take, and no Triton
        return add_norm(x_MC, delta_MC, norm_C, eps, offset=offset, delta_norm_C=delta_norm_C)
    out = _add_norm_call(x_MC, delta_MC, norm_C, delta_norm_C, eps=eps,
                         offset=offset, interpret=mode == "interpret", digits=digits, tuning=t)
    return (out[0], DigitRow(*out[1:])) if digits else out


@functools.partial(jax.jit, static_argnames=("eps", "offset", "interpret", "digits", "tuning"))
def _add_norm_call(x_MC, delta_MC, norm_C, delta_norm_C=None, *, eps, interpret, digits=False,
                   tuning: KernelTuning, offset: float = 0.0):
    M, C = x_MC.shape
    P = pow2(C)  # the row's tile, masked past C
    rows = min(tuning.add_norm_rows, M & -M)
    # The early-launch signal only where all programs fit on the GPU at once: decode steps
    # (docs/decisions/add-norm.md#early-launch-signal-in-decode-only).
    trigger = (tuning.add_norm_trigger and pdl_trigger(interpret, tuning)
               and M // rows <= runtime.multiprocessors())
    block = pl.BlockSpec((rows, C), lambda i: (i, 0))
    # as layers.rms_norm: the weight's dtype promotes the plain product; an offset's is x's
    normed_dtype = x_MC.dtype if offset else jnp.result_type(norm_C.dtype, x_MC.dtype)
    out_specs = [block, block]
    out_shape = [jax.ShapeDtypeStruct((M, C), x_MC.dtype), jax.ShapeDtypeStruct((M, C), normed_dtype)]
    if digits:  # one row (M = 1): its digits, their factor, its sum of magnitudes
        out_specs += [pl.BlockSpec((DIGIT_ROWS, C), lambda i: (0, 0))] + \
            [pl.BlockSpec((1,), lambda i: (0,))] * 2
        out_shape += [jax.ShapeDtypeStruct((DIGIT_ROWS, C), jnp.int8)] + \
            [jax.ShapeDtypeStruct((1,), jnp.float32)] * 2
    vector = pl.BlockSpec((C,), lambda i: (0,))
    post = delta_norm_C is not None
    return pl.pallas_call(
        functools.partial(_add_norm_kernel, C=C, P=P, eps=eps, trigger=trigger, offset=offset,
                          post=post),
        grid=(M // rows,), in_specs=[block, block, vector] + [vector] * post, out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(
            num_warps=tuning.add_norm_digit_warps if digits else tuning.add_norm_warps, num_stages=1),
        interpret=interpret, name="add_norm")(x_MC, delta_MC, norm_C, *[delta_norm_C] * post)


def _add_norm_kernel(x_ref, d_ref, g_ref, *refs, C, P, eps, trigger=False, offset=0.0,
                     post=False):
    """A few rows: the sum rounded to x's dtype (as XLA's add), then `layers.rms_norm` of it;
    with `digit_refs` (digits, factor, l1) also the one row's `DigitRow` digits and its sum of
    magnitudes. With `post` (Gemma) the delta is `layers.rms_norm`ed first by the next ref's
    weight; with an `offset` both norms scale by (offset + w) in float32, as `layers.rms_norm`."""
    if post:
        pg_ref, *refs = refs
    sum_ref, normed_ref, *digit_refs = refs
    f32 = jnp.float32
    cols = (jnp.arange(P) < C)[None, :]
    if trigger:  # the signal's result used, so that the compiler keeps it
        cols = cols & (launch_dependents(pl.program_id(0)) >= 0)
    at = (pl.ds(0, x_ref.shape[0]), pl.ds(0, P))
    x = plt.load(x_ref.at[at], mask=cols, other=0).astype(f32)
    d = plt.load(d_ref.at[at], mask=cols, other=0).astype(f32)
    g = plt.load(g_ref.at[pl.ds(0, P)], mask=cols[0], other=0).astype(f32)

    def rms_normed(v, w, dtype):  # layers.rms_norm of the float32 rows v by weight w, rounded to dtype
        v = v * jax.lax.rsqrt(jnp.sum(v * v, axis=1, keepdims=True) / C + eps)
        if offset:  # (offset + w), in float32
            return (v * (offset + w[None, :])).astype(dtype)
        v = v.astype(x_ref.dtype)
        return (w[None, :] * v.astype(f32)).astype(dtype)

    if post:  # the delta through its own norm first, rounded to x's dtype as XLA's norm rounds it
        pg = plt.load(pg_ref.at[pl.ds(0, P)], mask=cols[0], other=0).astype(f32)
        d = rms_normed(d, pg, x_ref.dtype).astype(f32)
    total = (x + d).astype(sum_ref.dtype)
    plt.store(sum_ref.at[at], total, mask=cols)
    normed = rms_normed(total.astype(f32), g, normed_ref.dtype)
    plt.store(normed_ref.at[at], normed, mask=cols)
    if digit_refs:
        *digit_refs, l1_ref = digit_refs
        store_digits(normed[0].astype(f32), cols[0], *digit_refs)
        l1_ref[...] = jnp.sum(jnp.abs(normed.astype(f32))).reshape(1)


# --- Mosaic GPU ----------------------------------------------------------------------------------

BOX = 64  # the Mosaic GPU form holds a row as rows of 64: one TMA copy a row and operand


def mosaic_supports(C: int, digits: bool = False, dtype=None, *norms) -> bool:
    """The Mosaic GPU form's limits: widths of whole rows of 64 within one TMA copy (at most 256
    rows of 64), no digits, and norm weights of the row's dtype (values of two dtypes take two
    register layouts there, which do not combine); the Triton kernel takes the rest."""
    return (C % BOX == 0 and C // BOX <= 256 and not digits
            and all(n.dtype == dtype for n in norms))


@functools.partial(jax.jit, static_argnames=("eps", "offset", "interpret", "tuning"))
def _mosaic_add_norm_call(x_MC, delta_MC, norm_C, delta_norm_C=None, *, eps, interpret,
                          tuning: KernelTuning, offset: float = 0.0):
    """`_add_norm_call`'s arithmetic on Mosaic GPU, no digits: a program a row, each operand in by
    one TMA copy (the row as [C / 64, 64]) into shared memory, computed there by one warpgroup
    (rows padded to a multiple of 512 values, its layout's unit, the padding zero), both results
    out by TMA. In "interpret" mode it runs in Mosaic GPU's interpreter (`common.MOSAIC_INTERPRET`)."""
    M, C = x_MC.shape
    R, RP = C // BOX, -(-C // 512) * 512 // BOX  # rows of 64, and as padded
    post = delta_norm_C is not None
    normed_dtype = x_MC.dtype if offset else jnp.result_type(norm_C.dtype, x_MC.dtype)
    interpret_params = mosaic_interpret(interpret, "add_norm")
    # as the Triton kernel: the early-launch signal where all programs fit on the GPU at once
    trigger = (tuning.add_norm_trigger and pdl_trigger(interpret, tuning) and M <= runtime.multiprocessors())
    ins = [x_MC, delta_MC, norm_C] + [delta_norm_C] * post
    boxes = [a.reshape(*a.shape[:-1], R, BOX) for a in ins]
    out_type = (jax.ShapeDtypeStruct((M, R, BOX), x_MC.dtype), jax.ShapeDtypeStruct((M, R, BOX), normed_dtype))
    smem = [plgpu.SMEM((RP, BOX), a.dtype) for a in ins] + [plgpu.SMEM((RP, BOX), o.dtype) for o in out_type]

    @functools.partial(plgpu.kernel, out_type=out_type, grid=(M,), grid_names=("rows",),
                       scratch_types=dict(smem=smem, bar=plgpu.Barrier(num_arrivals=len(ins))),
                       interpret=interpret_params)
    def kernel(*refs, smem, bar):
        in_refs, (sum_ref, normed_ref) = refs[:len(ins)], refs[len(ins):]
        row = jax.lax.axis_index("rows")
        if trigger:
            plgpu.griddepcontrol_wait()
            plgpu.griddepcontrol_launch_dependents()
        if RP != R:  # the padding zero, before the copies land
            for s in smem[:len(ins)]:
                s[...] = jnp.zeros(s.shape, s.dtype)
            plgpu.commit_smem()
        for ref, s in zip(in_refs, smem):
            plgpu.copy_gmem_to_smem(ref.at[row] if ref.ndim == 3 else ref, s.at[pl.ds(0, R)], bar)
        plgpu.barrier_wait(bar)
        x_s, d_s, g_s, *pg_s = smem[:len(ins)]
        sum_s, normed_s = smem[len(ins):]
        f32 = jnp.float32

        def rms_normed(v, w, dtype):  # `_add_norm_kernel`'s, on [RP, 64] values
            v = v * jax.lax.rsqrt(jnp.sum(v * v) / C + eps)
            if offset:
                return (v * (offset + w)).astype(dtype)
            return (w * v.astype(x_MC.dtype).astype(f32)).astype(dtype)

        d = d_s[...].astype(f32)
        if post:
            d = rms_normed(d, pg_s[0][...].astype(f32), x_MC.dtype).astype(f32)
        total = (x_s[...].astype(f32) + d).astype(sum_s.dtype)
        sum_s[...] = total
        normed_s[...] = rms_normed(total.astype(f32), g_s[...].astype(f32), normed_s.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(sum_s.at[pl.ds(0, R)], sum_ref.at[row])
        plgpu.copy_smem_to_gmem(normed_s.at[pl.ds(0, R)], normed_ref.at[row])
        plgpu.wait_smem_to_gmem(0)
    sums, normed = kernel(*boxes)
    return sums.reshape(M, C), normed.reshape(M, C)
