"""The int8 tensor-core path: a row as int8 digits of base 256 with one float32 factor (`DigitRow`),
multiplied by int8 weights as exact int32 tensor-core products, with no conversion of the weights
(docs/decisions/int8.md#int8-digits-gateup-on-tensor-cores). `add_norm` writes a normed row's
digits for a large int8 gate/up or lm_head; gate/up's kernel writes its output's for down."""

import functools
import math

import jax
import jax.numpy as jnp
from flax import struct

from jaxllm.kernels.common import pl, plt, launch_dependents, pdl_trigger, power_of_2, swiglu as _swiglu
from jaxllm.kernels.tuning import KernelTuning, current

DIGITS = 4  # a normed row's digits (`add_norm`'s): 32 bits, the unit 2^-30 of its largest value
# gate/up's output for down: the unit set by a loose bound every program knows at once
# (`down_bounds`), so five digits (docs/decisions/int8.md#int8-digits-down-from-gateups-output).
DOWN_DIGITS = 5
DIGIT_ROWS = 16  # a tensor-core product's fewest rows: the digits, then rows never read


@struct.dataclass
class DigitRow:
    """One row x [1, C] in the model dtype ([1, 1, C] in `model`'s hands), with its int8 digits
    [DIGIT_ROWS, C] (rows past `count` never read) and float32 factor [1]:
    x = factor * sum_d digits[d] 256^d. `add_norm`'s normed rows have DIGITS digits and their
    sum of magnitudes `l1` [1]; gate/up's output for the down projection has DOWN_DIGITS."""
    x: jax.Array
    digits: jax.Array
    factor: jax.Array
    l1: jax.Array | None = None
    count: int = struct.field(pytree_node=False, default=DIGITS)


def tiles(kind: str, tuning: KernelTuning):
    """(rows, chunk, warps, stages) of the kernel for `kind`: "gate_up", "head" or "down"."""
    return {"gate_up": tuning.digit_tiles, "head": tuning.head_digit_tiles,
            "down": tuning.down_digit_tiles}[kind]


def supports(w_NC, kind: str, tuning: KernelTuning | None = None) -> bool:
    """The kernel's hard limits for an int8 w of `kind` ("gate_up": [2, F, C]; "head" or "down":
    [..., C]): the tiles divide it, and C * 128 * 127 < 2^31, so that the int32 sums cannot wrap."""
    rows, chunk, _, _ = tiles(kind, tuning or current())
    N, C = (w_NC.shape[1] if kind == "gate_up" else math.prod(w_NC.shape[:-1])), w_NC.shape[-1]
    return N % rows == 0 and C % chunk == 0 and C * 128 * 127 < 2**31


def down_bounds(gate_ups) -> jax.Array:
    """[L] float32 from the int8 gate/up matrices [2, F, C] of L layers: 127^2 times the largest
    gate scale times the largest up scale. Times the squared sum of magnitudes of the normed row
    x (`DigitRow.l1`), it bounds |silu(gate) * up| (|q| <= 127 and |silu(g)| <= |g|), which sets
    the unit of the digits that gate/up's kernel writes for down."""
    if len({w.scale.shape for w in gate_ups}) == 1:  # one reduction for all of them
        largest = jnp.max(jnp.stack([w.scale for w in gate_ups]), axis=-1)
    else:
        largest = jnp.stack([jnp.max(w.scale, axis=-1) for w in gate_ups])
    largest = largest.astype(jnp.float32)
    return largest[:, 0] * largest[:, 1] * 127.0**2


@functools.partial(jax.jit, static_argnames=("kind", "out_dtype", "interpret", "tuning"))
def _digits_call(row: DigitRow, w, bounds=None, index=None, *, kind, out_dtype, interpret,
                 tuning: KernelTuning | None = None):
    """`project(row, w)` of a `DigitRow` against a quantized w [N, C], or for `kind` "gate_up"
    against SwiGLU's gate/up [2, F, C]: one program per `rows` output channels (of each of gate
    and up), its weights streamed in chunks. With `bounds` (`down_bounds`) and the layer's
    `index` in them, gate/up's output comes back as a `DigitRow` of DOWN_DIGITS digits too."""
    tuning = tuning or current()
    swiglu = kind == "gate_up"
    q, scale = w.q, w.scale.astype(jnp.float32)
    rows, chunk, warps, stages = tiles(kind, tuning)  # dividing N and C (`supports`)
    N, C = q.shape[-2:]
    if swiglu:
        w_specs = [pl.BlockSpec((None, rows, C), lambda j, p=p: (p, j, 0)) for p in (0, 1)]
        s_specs = [pl.BlockSpec((None, rows), lambda j, p=p: (p, j)) for p in (0, 1)]
        args = [q, q, scale, scale]
    else:
        w_specs = [pl.BlockSpec((rows, C), lambda j: (j, 0))]
        s_specs = [pl.BlockSpec((rows,), lambda j: (j,))]
        args = [q, scale]
    whole = lambda n: pl.BlockSpec((n,), lambda j: (0,))
    out_specs = pl.BlockSpec((1, rows), lambda j: (0, j))
    out_shape = jax.ShapeDtypeStruct((1, N), out_dtype)
    digits_out = bounds is not None
    if digits_out:  # the row's sum of magnitudes, the bounds, the layer's index; digits out
        s_specs += [whole(1), whole(bounds.shape[0]), whole(1)]
        args += [row.l1, bounds, jnp.reshape(index, (1,)).astype(jnp.int32)]
        out_specs = [out_specs, pl.BlockSpec((DIGIT_ROWS, rows), lambda j: (0, j)), whole(1)]
        out_shape = [out_shape, jax.ShapeDtypeStruct((DIGIT_ROWS, N), jnp.int8),
                     jax.ShapeDtypeStruct((1,), jnp.float32)]
    kernel = functools.partial(_digits_kernel, chunk=chunk, swiglu=swiglu, count=row.count,
                               digits_out=digits_out, trigger=pdl_trigger(interpret, tuning))
    out = pl.pallas_call(
        kernel, grid=(N // rows,),
        in_specs=[pl.BlockSpec((DIGIT_ROWS, C), lambda j: (0, 0)), whole(1)] + w_specs + s_specs,
        out_specs=out_specs, out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret, name=f"decode_{kind}_digits")(row.digits, row.factor, *args)
    return DigitRow(*out, count=DOWN_DIGITS) if digits_out else out


digits_call = _digits_call  # its jitted name kept: profiles and traces name it


def _digits_kernel(digits_ref, factor_ref, *refs, chunk, swiglu, count=DIGITS, digits_out=False,
                   trigger=False):
    """One program: its rows' int8 products with the `count` digits, chunk by chunk (a loop
    Triton pipelines), as int32 sums [DIGIT_ROWS, rows] (for gate and for up); each row's
    sum_d 256^d sums[d] * factor * scale; with `swiglu` silu(gate) * up as `layers.mlp` rounds it.
    With `digits_out` (SwiGLU's) also that output's DOWN_DIGITS digits, in the unit that the
    bound on it sets (`_store_down_digits`), and the unit as their factor."""
    f32, i32 = jnp.float32, jnp.int32
    n = 2 if swiglu else 1
    w_refs, s_refs, refs = refs[:n], refs[n:2 * n], refs[2 * n:]
    if digits_out:
        l1_ref, bounds_ref, index_ref, o_ref, out_digits_ref, out_factor_ref = refs
    else:
        (o_ref,) = refs
    rows = w_refs[0].shape[0]
    program = launch_dependents(pl.program_id(0)) if trigger else 0
    d = jnp.arange(DIGIT_ROWS)
    real = jnp.broadcast_to((d < count)[:, None], (DIGIT_ROWS, chunk))

    def step(k, sums):
        at = pl.multiple_of(k * chunk, chunk)
        x = plt.load(digits_ref.at[:, pl.ds(at, chunk)], mask=real, other=0)
        return tuple(acc + jax.lax.dot_general(x, plt.load(w_ref.at[:, pl.ds(at, chunk)]),
                                               (((1,), (1,)), ((), ())), preferred_element_type=i32)
                     for acc, w_ref in zip(sums, w_refs))

    sums = jax.lax.fori_loop(0, digits_ref.shape[1] // chunk, step,
                             (jnp.zeros((DIGIT_ROWS, rows), i32),) * n)
    place = jnp.where(d < count, power_of_2(8 * jnp.minimum(d, count - 1)), 0.0)[:, None]
    ys = [jnp.sum(acc.astype(f32) * place, axis=0) * factor_ref[0] * s_ref[...]
          for acc, s_ref in zip(sums, s_refs)]
    y = (_swiglu(*ys, o_ref.dtype) if swiglu else ys[0]).astype(o_ref.dtype)
    if trigger:  # the signal's result used, so that the compiler keeps it
        y = jnp.where(program >= 0, y, 0).astype(o_ref.dtype)
    o_ref[0, :] = y
    if digits_out:
        bound = bounds_ref[index_ref[0]] * l1_ref[0] * l1_ref[0]
        _store_down_digits(y.astype(f32), bound, out_digits_ref, out_factor_ref)


def _store_down_digits(v, bound, digits_ref, factor_ref):
    """A program's values v (float32 [rows]), |v| <= bound, as DOWN_DIGITS digits [DIGIT_ROWS,
    rows] (the block's) of the unit 2^u, u = e + 1 - 38 for bound < 2^e (one more for the
    roundings that made v, at most 2% above the bound): X = v / 2^u, |X| < 2^38, is
    T 2^24 + R (T = trunc(X 2^-24), R exact in float32 and truncated toward zero below the
    unit), and sum_d t_d 256^d spells it with t_0..t_2 the bytes of R + 0x808080 less 128 and
    t_3, t_4 those of the rest, T plus R's carry. The factor 2^u (the same in every program),
    NaN where the bound is not finite (then v may be too), so that the products are NaN."""
    i32 = jnp.int32
    biased = (jax.lax.bitcast_convert_type(bound, i32) >> 23) & 255  # bound < 2^(biased - 126)
    u = jnp.clip(biased - 126 + 1 - 38, -126, 91)
    X = v * power_of_2(-u)
    T = (X * 2.0**-24).astype(i32)  # |T| < 2^14
    Y = (X - T.astype(jnp.float32) * 2.0**24).astype(i32) + 0x808080
    Z = T + (Y >> 24) + 0x80
    ts = [((Y >> (8 * d)) & 255) - 128 for d in range(3)] + [(Z & 255) - 128, Z >> 8]
    for d, t in enumerate(ts):
        plt.store(digits_ref.at[pl.ds(d, 1), pl.ds(0, v.shape[0])], t.astype(jnp.int8)[None, :])
    factor_ref[...] = jnp.where(biased < 255, power_of_2(u), jnp.nan).reshape(1)


def store_digits(v, cols, digits_ref, factor_ref):
    """The row v (float32 [P], zero past the columns `cols`) as `DigitRow` digits and factor.

    Its largest magnitude m = f 2^e (f in [0.5, 1)) sets the unit 2^(e - 30): each value is an
    integer X of those units, |X| < 2^30 (truncated toward zero below the unit, which drops less
    than m 2^-30), written as X = sum_d t_d 256^d with t_0..t_2 in [-128, 127] (the bytes of
    X + 0x808080, less 128) and t_3 = (X + 0x808080) >> 24 in [-64, 64]. A row with an inf or
    NaN gets the factor NaN, so that its products are NaN as XLA's would be."""
    i32 = jnp.int32
    m = jnp.max(jnp.abs(v))
    biased = (jax.lax.bitcast_convert_type(m, i32) >> 23) & 255  # m's exponent field
    e = jnp.clip(biased - 126, -96, 128)  # frexp's; zero and tiny rows take -96
    X = (v * power_of_2(30 - e)).astype(i32)
    Y = X + 0x808080
    for d in range(DIGITS):
        t = (Y >> 24) if d == DIGITS - 1 else ((Y >> (8 * d)) & 255) - 128
        plt.store(digits_ref.at[pl.ds(d, 1), pl.ds(0, v.shape[0])], t.astype(jnp.int8)[None, :],
                  mask=cols[None, :])
    finite = jnp.sum(v * 0.0) == 0  # no inf or NaN in the row
    factor_ref[...] = jnp.where(finite, power_of_2(e - 30), jnp.nan).reshape(1)
