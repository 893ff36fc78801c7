#!/usr/bin/env python
"""Time one kernel in each GPU kernel backend a port off Pallas' Triton backend could take: one JSON
line per (width, form) on stdout, the rest on stderr. Needs a CUDA GPU.

    python scripts/bench_backends.py                       # widths 576, 2048, 4096
    python scripts/bench_backends.py --widths 4096 --chain 200

The kernel is residual add + RMSNorm of one row (`jaxllm.kernels.add_norm`, a decode step's
residual add and norm), written these ways:
  pallas_triton  jaxllm's kernel (Pallas on the Triton backend, which JAX 0.11 deprecated); on
                 Hopper it signals the next kernel's early launch (PDL), pallas_triton_nopdl not
  mosaic_gpu     Pallas on Mosaic GPU, below: TMA copies in and out through shared memory,
                 256 elements a copy
  mosaic_gpu_box the same with one copy an operand each way (the row as rows of 64);
                 mosaic_gpu_box_pdl also waits for the kernel ahead and signals the next (PDL)
  mosaic_gpu_regs Mosaic GPU without shared memory (widths that are multiples of 512)
  jax_triton     the same arithmetic in Triton's own language, called through jax-triton (only
                 where `triton` and `jax_triton` import; the line says why not otherwise);
                 jax_triton_ffi the same through jaxlib's FFI handler, as jax-triton's main
                 0.4.1 lowers it (0.3.1, the newest for Python 3.11, takes the legacy custom call)
  xla            `add_norm`'s XLA form (`layers.rms_norm`), XLA's fusion
A decode step is launch-bound at small widths, so what matters is a call's cost among others: the
forms are timed as `--chain` calls one after another in one jitted program (each call's outputs the
next one's inputs), the best of `--repeat` runs, over `--chain`.

JSON keys: kernel, form, width, chain, us_per_call, max_abs_err (against xla, in bf16), device,
jax_version, available, error.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp

EPS = 1e-6
TMA_MAX = 256  # a TMA copy moves at most 256 elements along a dimension


def xla(x, d, g):
    """(x + d, rms_norm(x + d) * g): `add_norm`'s XLA form, what a step runs without the kernel;
    the reference of the others."""
    from jaxllm.kernels import add_norm
    return add_norm(x, d, g, EPS)


def pallas_triton(x, d, g, pdl: bool = True):
    """jaxllm's kernel, as a decode step runs it: on Hopper it signals the next kernel's early
    launch (PDL) at its start; with `pdl` False it does not."""
    from jaxllm.kernels import add_norm
    from jaxllm.kernels.tuning import current
    return add_norm(x, d, g, EPS, mode="gpu", tuning=dataclasses.replace(current(), add_norm_trigger=pdl))


def _add_norm_in_smem(smem, D: int):
    """The Mosaic GPU forms' arithmetic, as `layers.rms_norm`'s, in shared memory: x, d, g in its first three
    rows (their padding zeros), h written over x and the normed row into the fourth."""
    dtype = smem.dtype
    h = (smem[0].astype(jnp.float32) + smem[1].astype(jnp.float32)).astype(dtype).astype(jnp.float32)
    y = (h * jax.lax.rsqrt(jnp.sum(h * h) / D + EPS)).astype(dtype).astype(jnp.float32)
    smem[0] = h.astype(dtype)
    smem[3] = (y * smem[2].astype(jnp.float32)).astype(dtype)


def mosaic_gpu(x, d, g):
    """One row through shared memory: every operand in by TMA (256 elements a copy), the sum and
    the normed row computed by one warpgroup, both out by TMA. The row is padded in shared memory to
    a multiple of 512 (a warpgroup's 128 threads times 4 elements), its tail cleared first."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
    _, D = x.shape
    P = -(-D // 512) * 512
    pieces = [(o, min(TMA_MAX, D - o)) for o in range(0, D, TMA_MAX)]

    @functools.partial(plgpu.kernel, out_type=(jax.ShapeDtypeStruct(x.shape, x.dtype),) * 2,
                       scratch_types=dict(smem=plgpu.SMEM((4, P), x.dtype),
                                          bar=plgpu.Barrier(num_arrivals=3 * len(pieces))))
    def kernel(x_ref, d_ref, g_ref, h_ref, y_ref, smem, bar):
        if P != D:
            for i in range(3):
                smem[i] = jnp.zeros((P,), x.dtype)
            plgpu.commit_smem()  # the clearing lands before the copies do
        for i, ref in enumerate((x_ref.at[0], d_ref.at[0], g_ref)):
            for o, n in pieces:
                plgpu.copy_gmem_to_smem(ref.at[pl.ds(o, n)], smem.at[i, pl.ds(o, n)], bar)
        plgpu.barrier_wait(bar)
        _add_norm_in_smem(smem, D)
        plgpu.commit_smem()
        for i, ref in ((0, h_ref.at[0]), (3, y_ref.at[0])):
            for o, n in pieces:
                plgpu.copy_smem_to_gmem(smem.at[i, pl.ds(o, n)], ref.at[pl.ds(o, n)])
        plgpu.wait_smem_to_gmem(0)
    return kernel(x, d, g)


BOX_COLS = 64


def mosaic_gpu_box(x, d, g, pdl: bool = False):
    """mosaic_gpu with one TMA copy an operand each way: the row as rows of 64 (a free reshape), so
    a copy's box is (D / 64, 64), within TMA's 256 along each dimension up to D = 16384. With
    `pdl`, as the Triton kernel: it waits for the kernel ahead, then signals the next one's launch."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
    _, D = x.shape
    if D % BOX_COLS:
        raise ValueError(f"mosaic_gpu_box takes widths that are multiples of {BOX_COLS}, not {D}")
    R, RP = D // BOX_COLS, -(-D // 512) * 512 // BOX_COLS  # rows, and rows padded as mosaic_gpu pads

    @functools.partial(plgpu.kernel, out_type=(jax.ShapeDtypeStruct((R, BOX_COLS), x.dtype),) * 2,
                       scratch_types=dict(smem=plgpu.SMEM((4, RP, BOX_COLS), x.dtype),
                                          bar=plgpu.Barrier(num_arrivals=3)))
    def kernel(x_ref, d_ref, g_ref, h_ref, y_ref, smem, bar):
        if pdl:
            plgpu.griddepcontrol_wait()
            plgpu.griddepcontrol_launch_dependents()
        if RP != R:
            for i in range(3):
                smem[i] = jnp.zeros((RP, BOX_COLS), x.dtype)
            plgpu.commit_smem()
        for i, ref in enumerate((x_ref, d_ref, g_ref)):
            plgpu.copy_gmem_to_smem(ref, smem.at[i, pl.ds(0, R)], bar)
        plgpu.barrier_wait(bar)
        _add_norm_in_smem(smem, D)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem.at[0, pl.ds(0, R)], h_ref)
        plgpu.copy_smem_to_gmem(smem.at[3, pl.ds(0, R)], y_ref)
        plgpu.wait_smem_to_gmem(0)
    h, y = kernel(x.reshape(R, BOX_COLS), d.reshape(R, BOX_COLS), g.reshape(R, BOX_COLS))
    return h.reshape(1, D), y.reshape(1, D)


def mosaic_gpu_regs(x, d, g):
    """No shared memory: each operand loaded from global memory straight into registers and the
    results stored back, for widths a warpgroup splits evenly (multiples of 512)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    _, D = x.shape
    if D % 512:
        raise ValueError(f"mosaic_gpu_regs takes widths that are multiples of 512, not {D}")

    @functools.partial(plgpu.kernel, out_type=(jax.ShapeDtypeStruct((D,), x.dtype),) * 2)
    def kernel(x_ref, d_ref, g_ref, h_ref, y_ref):
        layout = plgpu.Layout.WG_STRIDED((D,), vec_size=4)
        xs, ds_, gs = (plgpu.load(r, (), layout=layout).astype(jnp.float32) for r in (x_ref, d_ref, g_ref))
        h = (xs + ds_).astype(x.dtype).astype(jnp.float32)
        y = (h * jax.lax.rsqrt(jnp.sum(h * h) / D + EPS)).astype(x.dtype).astype(jnp.float32)
        h_ref[...] = h.astype(x.dtype)
        y_ref[...] = (y * gs).astype(x.dtype)
    h, y = kernel(x.reshape(D), d.reshape(D), g)
    return h.reshape(1, D), y.reshape(1, D)


@functools.cache
def _triton_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x_ptr, d_ptr, g_ptr, h_ptr, y_ptr, D: tl.constexpr, B: tl.constexpr, eps: tl.constexpr):
        o = tl.arange(0, B)
        m = o < D
        h = tl.load(x_ptr + o, mask=m, other=0.).to(tl.float32) + tl.load(d_ptr + o, mask=m, other=0.).to(tl.float32)
        h = h.to(tl.bfloat16).to(tl.float32)
        y = (h * tl.rsqrt(tl.sum(h * h, 0) / D + eps)).to(tl.bfloat16).to(tl.float32)
        y = y * tl.load(g_ptr + o, mask=m, other=0.).to(tl.float32)
        tl.store(h_ptr + o, h.to(tl.bfloat16), mask=m)
        tl.store(y_ptr + o, y.to(tl.bfloat16), mask=m)
    return kernel, triton.next_power_of_2


FFI_TARGET = "triton_kernel_call_ffi"  # jaxlib's typed (FFI) handler of a Triton kernel call


@functools.cache
def _ffi_lowering_patch():
    """jax-triton 0.3.1 lowers to jaxlib's legacy `triton_kernel_call` (custom call API version
    2); jax-triton 0.4.1 (Python 3.12, JAX 0.11, triton 3.7), and Pallas' Triton backend past
    jaxlib 0.10.2, lower to the FFI handler. This wraps `jax.ffi.ffi_lowering` so that a call asking for FFI_TARGET by
    name takes the handler, the same proto as its `opaque` attribute, as 0.4.1 emits it."""
    import jax.ffi
    plain = jax.ffi.ffi_lowering

    def lowering(name, *, api_version=4, backend_config=None, **kw):
        if name != FFI_TARGET or api_version == 4:
            return plain(name, api_version=api_version, backend_config=backend_config, **kw)
        rule = plain(name, api_version=4, **kw)
        return lambda ctx, *args: rule(ctx, *args, opaque=backend_config)
    jax.ffi.ffi_lowering = lowering


def jax_triton(x, d, g, ffi: bool = False):
    """The Triton-language kernel through jax-triton's call; with `ffi`, lowered to jaxlib's FFI
    handler (`_ffi_lowering_patch`) instead of jax-triton 0.3.1's legacy custom call."""
    import jax_triton as jt
    if ffi:
        _ffi_lowering_patch()
    kernel, pow2 = _triton_kernel()
    D = x.shape[-1]
    target = {"custom_call_target_name": FFI_TARGET} if ffi else {}
    return jt.triton_call(x, d, g, kernel=kernel, out_shape=(jax.ShapeDtypeStruct(x.shape, x.dtype),) * 2,
                          grid=(1,), num_warps=4, num_stages=1, D=D, B=pow2(D), eps=EPS, **target)


FORMS = {"pallas_triton": pallas_triton, "pallas_triton_nopdl": functools.partial(pallas_triton, pdl=False),
         "mosaic_gpu": mosaic_gpu, "mosaic_gpu_box": mosaic_gpu_box,
         "mosaic_gpu_box_pdl": functools.partial(mosaic_gpu_box, pdl=True), "mosaic_gpu_regs": mosaic_gpu_regs,
         "jax_triton": jax_triton, "jax_triton_ffi": functools.partial(jax_triton, ffi=True), "xla": xla}


def chained(form, n: int):
    """n calls of `form` in one program, each on the previous one's outputs."""
    def run(x, d, g):
        for _ in range(n):
            x, d = form(x, d, g)
        return x, d
    return jax.jit(run)


def measure(name: str, width: int, chain: int, repeat: int) -> dict:
    line = dict(kernel="add_norm", form=name, width=width, chain=chain, us_per_call=None, max_abs_err=None,
                device=jax.devices()[0].device_kind, jax_version=jax.__version__, available=True, error=None)
    x, d, g = (jax.random.normal(jax.random.key(i), shape, jnp.bfloat16)
               for i, shape in enumerate(((1, width), (1, width), (width,))))
    try:
        got = jax.jit(FORMS[name])(x, d, g)
        line["max_abs_err"] = max(float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max())
                                  for a, b in zip(got, xla(x, d, g)))
        run = chained(FORMS[name], chain)
        jax.block_until_ready(run(x, d, g))
        best = float("inf")
        for _ in range(repeat):
            t = time.perf_counter()
            jax.block_until_ready(run(x, d, g))
            best = min(best, time.perf_counter() - t)
        line["us_per_call"] = round(best / chain * 1e6, 3)
    except ImportError as e:
        line.update(available=False, error=f"{type(e).__name__}: {e}")
    except Exception as e:  # a form that fails to lower or compile on this JAX is a result too
        line["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    return line


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--widths", default="576,2048,4096", help="row widths, a comma list (default: 576,2048,4096)")
    p.add_argument("--forms", default=",".join(FORMS), help=f"a comma list of {', '.join(FORMS)} (default: all)")
    p.add_argument("--chain", type=int, default=100, help="calls in one timed program (default: 100)")
    p.add_argument("--repeat", type=int, default=5, help="timed runs, the best kept (default: 5)")
    args = p.parse_args(argv)
    try:
        widths = [int(w) for w in args.widths.split(",")]
    except ValueError:
        p.error(f"--widths must be a comma list of integers, got {args.widths!r}")
    forms = args.forms.split(",")
    if unknown := [f for f in forms if f not in FORMS]:
        p.error(f"unknown form {unknown[0]!r}: choose from {', '.join(FORMS)}")
    if min(widths) < 1 or args.chain < 1 or args.repeat < 1:
        p.error("--widths, --chain and --repeat must be >= 1")
    if jax.default_backend() != "gpu":
        print(f"bench_backends: needs a CUDA GPU (JAX's backend here is {jax.default_backend()})", file=sys.stderr)
        return 2
    for width in widths:
        for name in forms:
            line = measure(name, width, args.chain, args.repeat)
            print(json.dumps(line), flush=True)
            print(f"{name:14s} width {width:5d}: {line['us_per_call']} us a call"
                  + (f" ({line['error']})" if line["error"] else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
