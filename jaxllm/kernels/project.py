"""One-row projection (batch-1 decode): [residual +] (rms_norm(x) if norm else x) @ w.T [+ bias], or
SwiGLU's silu(gate) * up, with the norm and the epilogue folded into the product's own kernel, where
XLA ran each as a kernel of its own (docs/decisions/one-row-projection.md). Takes float matrices up
to `kernel_max_weights` and int8 ones, converted in registers, up to `kernel_max_int8_weights`."""

import functools
import math

import jax
import jax.numpy as jnp

from jaxllm.kernels import common
from jaxllm.kernels import digits as D
from jaxllm.kernels.common import (pl, plgpu, plt, NEG, launch_dependents, mosaic_interpret, pdl_trigger, pow2,
                                   prefetch as _prefetch, swiglu as _swiglu, to_f32 as _to_f32)
from jaxllm.kernels.decode_attention import SplitHeads
from jaxllm.kernels.digits import DOWN_DIGITS, DigitRow
from jaxllm.kernels.tuning import KernelTuning, current
from jaxllm.layers import dense as L
from jaxllm.layers.quant import QuantizedWeight, stored


def supports(w_NC, swiglu: bool = False, biased: bool = False, tuning: KernelTuning | None = None) -> bool:
    """Whether the kernel takes w for one row: at most `kernel_max_weights` weights (int8 ones
    `kernel_max_int8_weights`; past those XLA's reduction streams faster), and no SwiGLU with a bias."""
    t = tuning or current()
    limit = t.kernel_max_int8_weights if isinstance(w_NC, QuantizedWeight) else t.kernel_max_weights
    return math.prod(w_NC.shape) <= limit and not (swiglu and biased)


def int8_tiled(w_NC, tuning: KernelTuning | None = None) -> bool:
    """Whether w is a large int8 matrix, past `kernel_max_weights`: in `int8_tiles`, its norm apart."""
    return isinstance(w_NC, QuantizedWeight) and math.prod(w_NC.shape) > (tuning or current()).kernel_max_weights


def project(x_MC, w_NC, *, norm_C=None, eps: float = 1e-6, bias_N=None, residual_MN=None,
            swiglu: bool = False, activation: str = "silu", out_dtype=None, mode: str | None = None,
            prefetch=(), weights_first: bool = False, down_digits_of=None, wide: bool | None = None,
            tuning: KernelTuning | None = None):
    """[residual +] (rms_norm(x) if norm else x) @ w.T [+ bias], or with `swiglu` (w [2, F, C]: gate
    and up) act(gate) * up, act silu or `activation` (`common.GATES`: Gemma's "gelu_tanh"): XLA's
    `layers` arithmetic, in one kernel when `mode` is "gpu" or "interpret", x is one row and
    `supports` w, else in XLA.

    w may be a `QuantizedWeight` (int8 rows, per-output scales), converted in registers.
    The kernel scales each row's products by the norm's inverse RMS after the sum (exact in real
    arithmetic), where XLA rounds the normalized x to its dtype first.
    x may be a `SplitHeads` (the heads of a decode step's attention, C = K*G*H) for a product
    without norm or SwiGLU: the kernel then combines the splits as it loads them, where they are
    few enough (`fused_heads_values`); else XLA combines them first.
    `prefetch`: matrices that a later kernel reads, which the kernel asks L2 for as it finishes
    (on a GPU), a hint that changes no result. `weights_first`: the kernel asks for its weights
    before its input, where they fit one chunk; the same result, bit for bit. A float matrix's
    kernel makes the norm's sum of squares after the products (`squares_last`), also bit for bit.
    `wide`: SwiGLU's programs take as many gate and up rows as others take rows (None: the
    tuning's `gate_up_wide`). The step plan (`jaxllm.model.plan`) makes these choices.
    x may be a `DigitRow` (`add_norm`'s, with `digits`): an int8 w that `digits.supports` then
    takes the tensor-core kernel; any other w, the row's x. With `down_digits_of` (the step's
    `down_bounds` and the layer's index in them) the gate/up kernel returns its output as a
    `DigitRow` too, for the down projection, which then takes the same kernel from it.
    """
    t = tuning or current()
    if isinstance(x_MC, DigitRow):
        # (the digits kernel's gate is silu)
        plain = norm_C is None and bias_N is None and residual_MN is None and activation == "silu"
        kind = "down" if x_MC.count == DOWN_DIGITS else "gate_up" if swiglu else "head"
        if plain and mode is not None and isinstance(w_NC, QuantizedWeight) and D.supports(w_NC, kind, t):
            return D.digits_call(x_MC, w_NC, *(down_digits_of or ()), kind=kind,
                                 out_dtype=jnp.dtype(out_dtype or x_MC.x.dtype),
                                 interpret=mode == "interpret", tuning=t)
        x_MC = x_MC.x
    heads = x_MC if isinstance(x_MC, SplitHeads) else None
    if heads is not None:
        M, C = heads.acc.shape[0], math.prod(heads.acc.shape[2:])
        out_dtype = out_dtype or heads.dtype
    else:
        M, C = x_MC.shape
        out_dtype = out_dtype or x_MC.dtype
    takes = M == 1 and mode is not None and supports(w_NC, swiglu, bias_N is not None, t)
    if heads is not None and not (takes and norm_C is None and not swiglu
                                  and heads_values(heads) <= t.fused_heads_values):
        x_MC, heads = heads.combined().reshape(M, C), None  # XLA combines the splits
    if takes and t.project_backend == "mosaic_gpu":
        if heads is not None:  # the Mosaic GPU form takes a plain row: XLA combines the splits
            x_MC, heads = heads.combined().reshape(M, C), None
        if mosaic_supports(w_NC, swiglu, x_MC.dtype):
            return _mosaic_project_call(x_MC, w_NC, norm_C, bias_N, residual_MN, eps=eps, swiglu=swiglu,
                                        activation=activation, out_dtype=jnp.dtype(out_dtype),
                                        interpret=mode == "interpret", tuning=t)
        takes = common.TRITON_MISSING is None  # the rest on the Triton kernel, where there is one
    if not takes:
        return project_xla(x_MC, w_NC, norm_C, eps, bias_N, residual_MN, swiglu, out_dtype, activation)
    float_w = not isinstance(w_NC, QuantizedWeight)  # its own order below where int8
    rows, chunk, warps = tiles(w_NC, swiglu, wide, t)
    interpret = mode == "interpret"
    ahead = () if interpret else tuple(  # int8 bytes only: the scales are few
        stored(w) for w in prefetch)
    return _project_kernel_call(x_MC, w_NC, norm_C, bias_N, residual_MN, ahead, eps=eps,
                                swiglu=swiglu, activation=activation,
                                out_dtype=jnp.dtype(out_dtype), rows=rows, chunk=chunk,
                                warps=warps, interpret=interpret,
                                lines=t.prefetch_lines and not weights_first,
                                weights_first=weights_first and heads is None and C <= chunk,
                                squares_last=t.squares_last and float_w,
                                permute_int8=not interpret and t.int8_convert == "permute",
                                trigger=pdl_trigger(interpret, t))


def tiles(w_NC, swiglu: bool = False, wide: bool | None = None,
          tuning: KernelTuning | None = None) -> tuple[int, int, int]:
    """The kernel's program for w: (output rows, the chunk of a row it loads at once, warps)."""
    t = tuning or current()
    C = w_NC.shape[-1]
    padded = pow2(C)
    width = w_NC.shape[1] if swiglu else w_NC.shape[0]
    if int8_tiled(w_NC, t):
        rows, max_chunk, warps = t.int8_tiles
        chunk = min(padded, max_chunk)
        if C % chunk and (C & -C) >= chunk // 2:  # whole chunks, not an overlapping last one
            chunk = C & -C
        return min(rows, width & -width), chunk, warps
    float_w = not isinstance(w_NC, QuantizedWeight)
    chunk = padded if float_w and C <= t.one_chunk_channels else min(padded, t.max_chunk)
    # At least 2 rows a program, as measured (a 1-row block never ran on a GPU), where they divide.
    # gate and up sharing the weights, but where gate/up comes from HBM unasked (`gate_up_wide`)
    halved = swiglu and not (t.gate_up_wide if wide is None else wide)
    rows = min(max(2, t.program_elements // chunk // (2 if halved else 1)), width & -width)
    return rows, chunk, t.project_warps


def heads_values(heads: SplitHeads) -> int:
    """The values of a `SplitHeads` row as the kernel holds them: splits and K*G to powers of two."""
    _, P, K, G, H = heads.acc.shape
    return pow2(P) * pow2(K * G) * H


def project_xla(x_MC, w_NC, norm_C, eps, bias_N, residual_MN, swiglu, out_dtype, activation="silu"):
    """`project` as the layers compose it in XLA."""
    if norm_C is not None:
        x_MC = L.rms_norm(x_MC, norm_C, eps)
    if swiglu:
        y_MN = L.project(x_MC, w_NC)
        y_MN = L.ACTIVATION[activation](y_MN[:, 0]) * y_MN[:, 1]
    else:
        y_MN = L.project(x_MC, w_NC, out_dtype)
    if bias_N is not None:
        y_MN = y_MN + bias_N
    return y_MN if residual_MN is None else residual_MN + y_MN


@functools.partial(jax.jit, static_argnames=("eps", "swiglu", "activation", "out_dtype", "rows", "chunk",
                                             "warps", "interpret", "weights_first",
                                             "squares_last", "lines", "permute_int8",
                                             "trigger"))
def _project_kernel_call(x_MC, w_NC, norm_C, bias_N, residual_MN, ahead=(), *, eps, swiglu,
                         out_dtype, rows, chunk, warps, interpret, activation="silu", weights_first=False,
                         squares_last=False, lines=False, permute_int8=False, trigger=False):
    """The pallas_call of `project`: one program per `rows` output channels."""
    scales = None
    if isinstance(w_NC, QuantizedWeight):
        w_NC, scales = w_NC.q, w_NC.scale
    C, heads = w_NC.shape[-1], None
    if isinstance(x_MC, SplitHeads):  # as [P, K*G, H] sums, [P, K*G] maxima and denominators
        _, P, K, G, H = x_MC.acc.shape
        heads = (P, K * G, H, x_MC.dtype)
        x_args = [x_MC.acc.reshape(P, K * G, H), x_MC.m.reshape(P, K * G), x_MC.l.reshape(P, K * G)]
        x_specs = [pl.BlockSpec(a.shape, lambda j, n=a.ndim: (0,) * n) for a in x_args]
        w_NC = w_NC.reshape(-1, K * G, H)  # rows of weights as [K*G, H], as the heads load
    width = w_NC.shape[1] if swiglu else w_NC.shape[0]
    if swiglu:  # gate and up rows of the same output channels, as two operands of one array
        w_specs = [pl.BlockSpec((None, rows, C), lambda j, p=p: (p, j, 0)) for p in (0, 1)]
        w_args = [w_NC, w_NC]
        s_specs = [pl.BlockSpec((None, rows), lambda j, p=p: (p, j)) for p in (0, 1)]
        s_args = [scales, scales]
    else:
        zeros = (0,) * (w_NC.ndim - 1)  # [rows, C], or [rows, K*G, H] against heads
        w_specs, w_args = [pl.BlockSpec((rows, *w_NC.shape[1:]), lambda j: (j, *zeros))], [w_NC]
        s_specs, s_args = [pl.BlockSpec((rows,), lambda j: (j,))], [scales]
    if scales is None:
        s_specs, s_args = [], []
    else:
        s_args = [s.astype(jnp.float32) for s in s_args]
    if heads is None:
        specs, args = [pl.BlockSpec((1, C), lambda j: (0, 0))], [x_MC]
    else:
        specs, args = x_specs, x_args
    if norm_C is not None:
        specs.append(pl.BlockSpec((C,), lambda j: (0,)))
        args.append(norm_C)
    specs += w_specs + s_specs
    args += w_args + s_args
    if bias_N is not None:
        specs.append(pl.BlockSpec((rows,), lambda j: (j,)))
        args.append(bias_N)
    if residual_MN is not None:
        specs.append(pl.BlockSpec((1, rows), lambda j: (0, j)))
        args.append(residual_MN)
    ahead = [a.reshape(-1) for a in ahead]  # flat: the ask takes its address, one element's block
    specs += [pl.BlockSpec((1,), lambda j: (0,)) for _ in ahead]
    args += ahead
    kernel = functools.partial(
        _project_kernel, C=C, chunk=chunk, eps=eps, swiglu=swiglu, activation=activation,
        norm=norm_C is not None,
        scaled=scales is not None, biased=bias_N is not None, residual=residual_MN is not None,
        heads=heads, permute_int8=permute_int8, trigger=trigger, grid=width // rows, lanes=32 * warps,
        ahead=tuple(a.size * a.dtype.itemsize // 16 * 16 for a in ahead),
        weights_first=weights_first, squares_last=squares_last or weights_first, lines=lines)
    return pl.pallas_call(
        kernel, grid=(width // rows,), in_specs=specs,
        out_specs=pl.BlockSpec((1, rows), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((1, width), out_dtype),
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=1),
        interpret=interpret, name="decode_project")(*args)


def _project_kernel(x_ref, *refs, C, chunk, eps, swiglu, norm, scaled, biased, residual, heads,
                    activation="silu", permute_int8=False, trigger=False, ahead=(), grid=1, lanes=128,
                    weights_first=False, squares_last=False, lines=False):
    """One program: `project` for a few output channels, reading their weight rows in as few
    chunks as fit (one for C <= chunk): each chunk is a single masked load, so the program waits
    on memory once per chunk, not once per loop step of a pipelined tile. With `heads` (splits,
    K*G, H, dtype), x_ref and the next two refs are a `SplitHeads`, combined here. With
    `weights_first` (one chunk, not against heads), the weights are asked for before x (see
    `weights_first`). With `squares_last` the norm's sum of squares is made after the products
    rather than between the loads of x and of the weights (`squares_last`)."""
    refs = list(refs)
    take = lambda n=1: [refs.pop(0) for _ in range(n)]
    if heads is not None:
        m_ref, l_ref = take(2)
    g_ref = take()[0] if norm else None
    w_refs = take(2 if swiglu else 1)
    s_refs = take(len(w_refs)) if scaled else [None] * len(w_refs)
    b_ref = take()[0] if biased else None
    r_ref = take()[0] if residual else None
    ahead_refs = take(len(ahead))  # `ahead`: each one's bytes (of 16s: bulk sizes are)
    (o_ref,) = refs
    f32, dtype = jnp.float32, x_ref.dtype
    rows = w_refs[0].shape[0]
    program = launch_dependents(pl.program_id(0)) if trigger else 0
    ys = [jnp.zeros((rows,), f32) for _ in w_refs]
    squares = jnp.zeros((1,), f32)
    if heads is not None:  # one load of the weights as [rows, K*G, H], against the combined heads
        x, real = _combined_heads(x_ref, m_ref, l_ref, *heads)
        w = plt.load(w_refs[0].at[:, pl.ds(0, real.shape[0]), :], mask=real[None, :, None],
                     other=0).astype(f32)
        ys = [jnp.sum(jnp.sum(w * x[None], axis=2), axis=1)]
    for done in range(0, C if heads is None else 0, chunk):  # a static loop: C / chunk is small
        # One chunk covering all of a short row (masked past C); for longer rows the last chunk
        # ends at C, overlapping the one before, its overlap masked.
        at = done if C <= chunk or done + chunk <= C else C - chunk
        cols = (at + jnp.arange(chunk) >= done) & (at + jnp.arange(chunk) < C)
        load = lambda w_ref: plt.load(w_ref.at[:, pl.ds(at, chunk)], mask=cols[None, :], other=0)
        ws = [load(w_ref) if weights_first else None for w_ref in w_refs]
        x = raw = plt.load(x_ref.at[pl.ds(0, 1), pl.ds(at, chunk)], mask=cols[None, :],
                           other=0).astype(f32)
        if norm:  # the inverse RMS scales the sums after the loop
            if not squares_last:
                squares = squares + jnp.sum(raw * raw, axis=1)
            x = x * plt.load(g_ref.at[pl.ds(at, chunk)], mask=cols, other=0).astype(f32)[None, :]
        ys = [y + jnp.sum(_to_f32(load(w_ref) if w is None else w, permute_int8) * x, axis=1)
              for y, w, w_ref in zip(ys, ws, w_refs)]
        if norm and squares_last:
            squares = squares + jnp.sum(raw * raw, axis=1)
    zeros = []  # the asks', folded into the store so that they stay
    for ref, nbytes in zip(ahead_refs, ahead):  # once this program's weights are in: they go first
        zero = _prefetch(ref, nbytes, grid, lanes, after=jnp.sum(ys[-1]), lines=lines)
        zeros += [] if zero is None else [jnp.sum(zero)]
    if norm:  # as layers.rms_norm: statistics in float32, eps inside the rsqrt
        ys = [y * jax.lax.rsqrt(squares / C + eps) for y in ys]
    ys = [y if s_ref is None else y * s_ref[...] for y, s_ref in zip(ys, s_refs)]
    if swiglu:
        y = _swiglu(*ys, dtype, activation)
    else:
        y = ys[0]
    y = y.astype(o_ref.dtype)
    if biased:
        y = y + b_ref[...].astype(o_ref.dtype)
    if residual:
        y = r_ref[0, :].astype(o_ref.dtype) + y
    if trigger or zeros:  # the signal's and the asks' results used, so that the compiler keeps them
        y = jnp.where((program >= 0) & (sum(zeros) == 0), y, 0).astype(o_ref.dtype)
    o_ref[0, :] = y


def _combined_heads(acc_ref, m_ref, l_ref, splits, KG, H, dtype):
    """`SplitHeads.combined` of one row as [KG', H] float32 (KG' = KG to a power of two, the
    padding zero), rounded to the heads' dtype as XLA's combine; and the mask of real rows."""
    SP, KGp = pow2(splits), pow2(KG)
    real = jnp.arange(KGp) < KG
    seen = (jnp.arange(SP) < splits)[:, None] & real[None, :]
    m = plt.load(m_ref.at[pl.ds(0, SP), pl.ds(0, KGp)], mask=seen, other=NEG)
    l = plt.load(l_ref.at[pl.ds(0, SP), pl.ds(0, KGp)], mask=seen, other=0)
    acc = plt.load(acc_ref.at[pl.ds(0, SP), pl.ds(0, KGp), pl.ds(0, H)], mask=seen[:, :, None],
                   other=0)
    w = jnp.exp(m - jnp.max(m, axis=0, keepdims=True))  # padded splits: exp(-1e30 - m) = 0
    total = jnp.where(real, jnp.sum(l * w, axis=0), 1.0)  # padded rows: 0 / 1, not 0 / 0
    combined = jnp.sum(acc * w[:, :, None], axis=0) / total[:, None]
    return combined.astype(dtype).astype(jnp.float32), real


# --- Mosaic GPU ----------------------------------------------------------------------------------

MOSAIC_ROWS = 64  # a program's output channels: a warpgroup's tile in the WGMMA register layout


def mosaic_supports(w_NC, swiglu: bool = False, dtype=None) -> bool:
    """The Mosaic GPU form's limits: a float matrix of x's dtype or an int8 one standing in for
    one (converted in registers; the same tiles at any size, where the Triton kernel takes
    `int8_tiles` past `kernel_max_weights`), and output and input channels in whole 64s."""
    if w_NC.dtype != dtype:
        return False
    width, C = (w_NC.shape[1] if swiglu else w_NC.shape[0]), w_NC.shape[-1]
    return width % MOSAIC_ROWS == 0 and C % 64 == 0


@functools.partial(jax.jit, static_argnames=("eps", "swiglu", "activation", "out_dtype", "interpret",
                                             "tuning"))
def _mosaic_project_call(x_MC, w_NC, norm_C, bias_N, residual_MN, *, eps, swiglu, activation,
                         out_dtype, interpret, tuning: KernelTuning):
    """`project` on Mosaic GPU (docs/decisions/kernel-backends.md): a program a tile of 64 output
    channels, their weight rows (gate's and up's with `swiglu`) streamed through shared memory by
    TMA in [64, block] blocks (`project_mosaic_stages` in flight), each times the row's block in
    float32 registers, summed once at the end; the norm's inverse RMS and the epilogue as
    `_project_kernel` applies them. In "interpret" mode it runs in Mosaic GPU's interpreter
    (`common.MOSAIC_INTERPRET`), without the layout casts, which change no value and which the
    interpreter has no rule for."""
    interpret_params = mosaic_interpret(interpret, "project")
    C = x_MC.shape[1]
    width = w_NC.shape[1] if swiglu else w_NC.shape[0]
    tiles = width // MOSAIC_ROWS
    block = 128 if C % 128 == 0 else 64
    scales = None
    if isinstance(w_NC, QuantizedWeight):  # int8 values; per-channel scales after the sums
        w_NC, scales = w_NC.q, w_NC.scale.astype(jnp.float32).reshape(-1)
    w_args = w_NC.reshape(-1, C)  # gate's rows, then up's
    cast = (lambda v, layout: v) if interpret else plgpu.layout_cast
    bits = jnp.dtype(w_NC.dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(block * bits)
    transforms = (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))
    # the row (and the norm's weight) in once, in copies of at most 256 values
    pieces = [(o, min(256, C - o)) for o in range(0, C, 256)]
    P = -(-C // 512) * 512  # shared memory's row, padded with zeros to the loads' unit
    norm, biased, residual = norm_C is not None, bias_N is not None, residual_MN is not None
    vectors = [x_MC.reshape(C)] + [norm_C] * norm  # in whole: the row, the norm's weight
    # 64 a tile: the scales (gate's, then up's), the bias, the residual
    tile_args = (([scales] if scales is not None else []) + ([bias_N] if biased else [])
                 + ([residual_MN.reshape(width)] if residual else []))
    tile_parts = [2 if swiglu and scales is not None and i == 0 else 1 for i in range(len(tile_args))]
    row_layout, col_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
    trigger = pdl_trigger(interpret, tuning)

    @functools.partial(
        plgpu.kernel, out_type=jax.ShapeDtypeStruct((width,), out_dtype), grid=(tiles,), grid_names=("n",),
        interpret=interpret_params,
        scratch_types=dict(vector_smem=[plgpu.SMEM((P,), v.dtype) for v in vectors],
                           tile_smem=[plgpu.SMEM((k, MOSAIC_ROWS), a.dtype) for a, k in zip(tile_args, tile_parts)],
                           out_smem=plgpu.SMEM((MOSAIC_ROWS,), out_dtype),
                           bar=plgpu.Barrier(num_arrivals=len(pieces) * len(vectors) + sum(tile_parts))))
    def kernel(*refs, vector_smem, tile_smem, out_smem, bar):
        vector_refs, w_ref = refs[:len(vectors)], refs[len(vectors)]
        tile_refs, (o_ref,) = refs[len(vectors) + 1:-1], refs[-1:]
        n = jax.lax.axis_index("n")
        here = pl.ds(n * MOSAIC_ROWS, MOSAIC_ROWS)
        if trigger:
            plgpu.griddepcontrol_wait()
            plgpu.griddepcontrol_launch_dependents()
        if P != C and norm:  # the padding zero, before the copies land: the norm sums the whole row
            vector_smem[0][...] = jnp.zeros((P,), vector_smem[0].dtype)
            plgpu.commit_smem()
        for ref, smem in zip(vector_refs, vector_smem):
            for o, size in pieces:
                plgpu.copy_gmem_to_smem(ref.at[pl.ds(o, size)], smem.at[pl.ds(o, size)], bar)
        for ref, smem, parts in zip(tile_refs, tile_smem, tile_parts):
            for p in range(parts):  # gate's and up's scales: the same tile of each half
                plgpu.copy_gmem_to_smem(ref.at[pl.ds((p * tiles + n) * MOSAIC_ROWS, MOSAIC_ROWS)],
                                        smem.at[p], bar)
        plgpu.barrier_wait(bar)
        f32 = jnp.float32

        def step(index, *blocks_and_sums):
            *w_blocks, sums = blocks_and_sums
            at = pl.ds(index[0] * block, block)
            x = cast(vector_smem[0][at], col_layout).astype(f32)
            if norm:  # the inverse RMS scales the sums after the loop
                x = x * cast(vector_smem[1][at], col_layout).astype(f32)
            x = jax.lax.broadcast_in_dim(x, (MOSAIC_ROWS, block), (1,))
            return tuple(s + w[...].astype(f32) * x for s, w in zip(sums, w_blocks))

        zero = cast(jnp.zeros((MOSAIC_ROWS, block), f32), plgpu.Layout.WGMMA)
        specs = [plgpu.BlockSpec((MOSAIC_ROWS, block), lambda k, p=p: (p * tiles + n, k), transforms=transforms)
                 for p in range(2 if swiglu else 1)]
        sums = plgpu.emit_pipeline(step, grid=(C // block,), in_specs=specs,
                                   max_concurrent_steps=tuning.project_mosaic_stages,
                                   init_carry=(zero,) * len(specs))(*[w_ref] * len(specs))
        ys = [s.sum(axis=1) for s in sums]
        if norm:  # as layers.rms_norm: statistics in float32, eps inside the rsqrt
            raw = vector_smem[0][...].astype(f32)
            ys = [y * jax.lax.rsqrt(jnp.sum(raw * raw) / C + eps) for y in ys]
        tiles_in = iter(tile_smem)
        if scales is not None:
            scale_smem = next(tiles_in)
            ys = [y * cast(scale_smem[p], row_layout) for p, y in enumerate(ys)]
        y = _swiglu(*ys, x_MC.dtype, activation) if swiglu else ys[0]
        y = y.astype(out_dtype)
        if biased:
            y = y + cast(next(tiles_in)[0], row_layout).astype(out_dtype)
        if residual:
            y = cast(next(tiles_in)[0], row_layout).astype(out_dtype) + y
        out_smem[...] = y
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, o_ref.at[here])
        plgpu.wait_smem_to_gmem(0)
    return kernel(*vectors, w_args, *tile_args).reshape(1, width)
