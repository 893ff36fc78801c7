"""Residual add and RMSNorm in one pass: the residual stream and the next block's normed input,
where XLA ran the add, the norm's reduction and its multiply as passes of their own
(docs/decisions/add-norm.md). Optionally writes the normed row's int8 digits (`digits.DigitRow`)."""

import functools

import jax
import jax.numpy as jnp

from jaxllm import runtime
from jaxllm.kernels.common import pl, plt, launch_dependents, pdl_trigger, pow2
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
    out = _add_norm_call(x_MC, delta_MC.astype(x_MC.dtype), norm_C, delta_norm_C, eps=eps,
                         offset=offset, interpret=mode == "interpret", digits=digits,
                         tuning=tuning or current())
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
