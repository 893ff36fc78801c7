#!/usr/bin/env python
"""Time GPU kernels in each kernel backend a port off Pallas' Triton backend could take: one JSON
line per (kernel, size, form) on stdout, the rest on stderr. Needs a CUDA GPU.

    python scripts/bench_backends.py                       # every kernel, its default sizes
    python scripts/bench_backends.py --kernels add_norm --widths 4096 --chain 200
    python scripts/bench_backends.py --kernels project --shapes 1536x576,2048x2048

Three kernels of a decode step, each written these ways:

add_norm, residual add + RMSNorm of one row (`jaxllm.kernels.add_norm`), at `--widths`:
  pallas_triton  jaxllm's kernel (Pallas on the Triton backend, which JAX 0.11 deprecated); on
                 Hopper it signals the next kernel's early launch (PDL), pallas_triton_nopdl not
  mosaic_gpu     Pallas on Mosaic GPU, below: TMA copies in and out through shared memory,
                 256 elements a copy
  mosaic_gpu_box the same with one copy an operand each way (the row as rows of 64);
                 mosaic_gpu_box_pdl also waits for the kernel ahead and signals the next (PDL)
  mosaic_gpu_regs Mosaic GPU without shared memory (widths that are multiples of 512)
  jax_triton     the same arithmetic in Triton's own language, called through jax-triton (only
                 where `triton` and `jax_triton` import; the line says why not otherwise);
                 jax_triton_ffi the same through jaxlib's FFI handler, as jax-triton
                 0.4.1 lowers it (0.3.1, the newest for Python 3.11, takes the legacy custom call)
  xla            `add_norm`'s XLA form (`layers.rms_norm`), XLA's fusion

project, one row times a bfloat16 matrix, y = x @ w.T (`jaxllm.kernels.project` without norm or
epilogue), at `--shapes` N x C (w is [N, C]; the chain alternates it with a [C, N] matrix):
  pallas_triton  jaxllm's kernel with the step's tiles (matrices up to `kernel_max_weights`,
                 past which the step takes XLA's form); pallas_triton_nopdl without PDL
  mosaic_gpu     jaxllm's Mosaic GPU form (JAXLLM_PROJECT_BACKEND=mosaic_gpu): a program a 64-row
                 tile, its weights streamed through shared memory by TMA in [64, 128] blocks, 4
                 in flight (`emit_pipeline`), each block times the row in registers;
                 mosaic_gpu_deep 8 blocks in flight
  jax_triton     the same tiles as jaxllm's kernel, in Triton's own language through jax-triton;
                 jax_triton_ffi through jaxlib's FFI handler (as for add_norm)
  xla            `project`'s XLA form (`layers.project`)

rows, M rows (8-32, a decode step's) times a bfloat16 matrix (`jaxllm.kernels.rows_project`
without epilogue), at `--rows-shapes` M x N x C, the chain as project's:
  pallas_triton  jaxllm's tensor-core kernel (Triton) with `rows_tiles`' tiles
  mosaic_gpu     a Mosaic GPU tensor-core (wgmma) kernel with the same tiles, the rows as the left
                 operand; not in the package (only a GPU checks its arithmetic: max_abs_err)
  xla            `rows_project`'s XLA form

A decode step is launch-bound at small sizes, so what matters is a call's cost among others: the
forms are timed as `--chain` calls one after another in one jitted program (each call's outputs the
next one's inputs; project's calls each read a matrix of their own, so that the chain streams them
from memory as a step does, not from L2), the best of `--repeat` runs, over `--chain`.

JSON keys: kernel, form, width (C), rows (N: the matrix's, 1 for add_norm), batch (M: rows', 1
for the others), chain, us_per_call, gb_per_s (project, rows: the matrix's bytes over
us_per_call), max_abs_err (against xla, in bf16), device, jax_version, available, error; with
`--profile`, device_us_per_call: the device's kernel time a call in one traced run of the chain
(`jaxllm.summarize`), so that us_per_call minus it is what a call costs between kernels (launch,
waits), not in them.
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
    jaxlib 0.10.2, lower to the FFI handler. This wraps `jax.ffi.ffi_lowering` so that a call
    asking for FFI_TARGET by name takes the handler, the same proto as its `opaque` attribute, as
    0.4.1 emits it."""
    import jax.ffi
    plain = jax.ffi.ffi_lowering

    def lowering(name, *, api_version=4, backend_config=None, **kw):
        if name != FFI_TARGET or api_version == 4:
            return plain(name, api_version=api_version, backend_config=backend_config, **kw)
        rule = plain(name, api_version=4, **kw)
        return lambda ctx, *args: rule(ctx, *args, opaque=backend_config)
    jax.ffi.ffi_lowering = lowering


def _triton_call(jt, *args, kernel, out, grid, num_warps, ffi: bool, **meta):
    """jax-triton's call of `kernel` on `args`, its outputs `out` (a shape or a tuple), in either
    API: 0.4 takes `out_type` and lowers to the FFI handler itself (so `ffi` is that release's
    plain call there); 0.3 takes `out_shape` and, with `ffi`, the target by name
    (`_ffi_lowering_patch`)."""
    if tuple(int(v) for v in jt.__version__.split(".")[:2]) >= (0, 4):
        return jt.triton_call(*args, kernel=kernel, out_type=out, grid=grid, num_warps=num_warps,
                              num_stages=1, **meta)
    if ffi:
        _ffi_lowering_patch()
        meta["custom_call_target_name"] = FFI_TARGET
    return jt.triton_call(*args, kernel=kernel, out_shape=out, grid=grid, num_warps=num_warps,
                          num_stages=1, **meta)


def jax_triton(x, d, g, ffi: bool = False):
    """The Triton-language kernel through jax-triton's call; with `ffi` and jax-triton 0.3,
    lowered to jaxlib's FFI handler (`_ffi_lowering_patch`) instead of its legacy custom call."""
    import jax_triton as jt
    kernel, pow2 = _triton_kernel()
    D = x.shape[-1]
    return _triton_call(jt, x, d, g, kernel=kernel, out=(jax.ShapeDtypeStruct(x.shape, x.dtype),) * 2,
                        grid=(1,), num_warps=4, ffi=ffi, D=D, B=pow2(D), eps=EPS)


FORMS = {"pallas_triton": pallas_triton, "pallas_triton_nopdl": functools.partial(pallas_triton, pdl=False),
         "mosaic_gpu": mosaic_gpu, "mosaic_gpu_box": mosaic_gpu_box,
         "mosaic_gpu_box_pdl": functools.partial(mosaic_gpu_box, pdl=True), "mosaic_gpu_regs": mosaic_gpu_regs,
         "jax_triton": jax_triton, "jax_triton_ffi": functools.partial(jax_triton, ffi=True), "xla": xla}


# --- project: one row times a matrix -------------------------------------------------------------

def project_xla(x, w):
    """`project`'s XLA form, the others' reference."""
    from jaxllm.kernels import project
    return project(x, w)


def _project_family():
    """The module `jaxllm.kernels.project` (the package's attribute of that name is its function)."""
    import importlib
    return importlib.import_module("jaxllm.kernels.project")


def project_pallas_triton(x, w, pdl: bool = True):
    """jaxllm's one-row kernel, its tiles as the step plan's tuning gives them."""
    from jaxllm.kernels import project
    from jaxllm.kernels.tuning import current
    tuning = dataclasses.replace(current(), pdl_trigger=pdl)
    if not _project_family().supports(w, tuning=tuning):
        raise ValueError(f"jaxllm's kernel takes matrices of up to {tuning.kernel_max_weights} weights, "
                         f"not {w.size}: a step takes XLA's form there")
    return project(x, w, mode="gpu", tuning=tuning)


def project_mosaic_gpu(x, w, stages: int = 4):
    """jaxllm's Mosaic GPU form of the kernel (JAXLLM_PROJECT_BACKEND=mosaic_gpu), `stages`
    weight blocks in flight."""
    from jaxllm.kernels import project
    from jaxllm.kernels.tuning import current
    tuning = dataclasses.replace(current(), project_backend="mosaic_gpu", project_mosaic_stages=stages)
    if not _project_family().mosaic_supports(w, dtype=x.dtype):
        raise ValueError(f"the Mosaic GPU form takes widths in whole 64s, not {w.shape}")
    return project(x, w, mode="gpu", tuning=tuning)


@functools.cache
def _triton_project_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x_ptr, w_ptr, y_ptr, C: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        acc = tl.zeros((ROWS,), tl.float32)
        for at in tl.static_range(0, C, CHUNK):
            cols = at + tl.arange(0, CHUNK)
            x = tl.load(x_ptr + cols, mask=cols < C, other=0.).to(tl.float32)
            w = tl.load(w_ptr + rows[:, None] * C + cols[None, :], mask=(cols < C)[None, :], other=0.)
            acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        tl.store(y_ptr + rows, acc.to(tl.bfloat16))
    return kernel


def project_jax_triton(x, w, ffi: bool = False):
    """The Triton-language form of jaxllm's kernel (its tiles, no epilogue) through jax-triton."""
    import jax_triton as jt
    (_, C), (N, _) = x.shape, w.shape
    rows, chunk, warps = _project_family().tiles(w)
    return _triton_call(jt, x, w, kernel=_triton_project_kernel(), out=jax.ShapeDtypeStruct((1, N), x.dtype),
                        grid=(N // rows,), num_warps=warps, ffi=ffi, C=C, ROWS=rows, CHUNK=chunk)


PROJECT_FORMS = {"pallas_triton": project_pallas_triton,
                 "pallas_triton_nopdl": functools.partial(project_pallas_triton, pdl=False),
                 "mosaic_gpu": project_mosaic_gpu, "mosaic_gpu_deep": functools.partial(project_mosaic_gpu, stages=8),
                 "jax_triton": project_jax_triton, "jax_triton_ffi": functools.partial(project_jax_triton, ffi=True),
                 "xla": project_xla}


# --- rows: a decode step's 8-32 rows times a matrix ----------------------------------------------

def rows_xla(x, w):
    """`rows_project`'s XLA form, the others' reference."""
    from jaxllm.kernels import rows_project
    return rows_project(x, w)


def rows_pallas_triton(x, w):
    """jaxllm's rows kernel (tensor cores, Triton), its tiles as `rows_tiles` gives them."""
    from jaxllm.kernels import rows_project
    from jaxllm.kernels.rows_project import supports
    if not supports(w):
        raise ValueError(f"jaxllm's rows kernel has no tiles for {w.shape}: a step takes XLA's form there")
    return rows_project(x, w, mode="gpu")


SMEM_BUDGET = 200 * 1024  # shared memory the pipeline's blocks may take (Hopper: 227 KB a block)


def rows_mosaic_gpu(x, w):
    """Pallas on Mosaic GPU, tensor cores (wgmma): a program a tile of `rows_tiles`' outputs; the
    rows as the left operand, a [64, chunk] block of x (the rows past x's last outside its bounds,
    which the TMA copy fills with zeros, and whose products are never stored), the matrix's tile as
    the right one, transposed in shared memory; as many blocks in flight as fit SMEM_BUDGET, at
    most 4. The tile is stored untransposed, the first M rows of it. Not in the package: Mosaic
    GPU's interpreter (JAX 0.10) has no transposed wgmma operand, so only a GPU checks it
    (docs/decisions/kernel-backends.md)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jaxllm.kernels.rows_project import rows_tiles
    (M, C), (N, _) = x.shape, w.shape
    tiles = rows_tiles(N, C)
    if tiles is None or M > 64:
        raise ValueError(f"no rows tiles for {M} rows of {w.shape}")
    outputs, chunk = tiles[:2]
    stages = max(1, min(4, SMEM_BUDGET // ((64 + outputs) * chunk * 2)))
    swizzle = plgpu.find_swizzle(chunk * 16)
    transforms = (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))

    @functools.partial(plgpu.kernel, out_type=jax.ShapeDtypeStruct((M, N), x.dtype), grid=(N // outputs,),
                       grid_names=("n",), scratch_types=dict(o_smem=plgpu.SMEM((64, outputs), x.dtype)))
    def kernel(x_ref, w_ref, o_ref, o_smem):
        n = jax.lax.axis_index("n")

        def sums(acc_ref):
            def step(index, x_smem, w_smem):
                plgpu.wgmma(acc_ref, x_smem, plgpu.transpose_ref(w_smem, (1, 0)))
                plgpu.wgmma_wait(0)
            plgpu.emit_pipeline(step, grid=(C // chunk,), max_concurrent_steps=stages, in_specs=[
                plgpu.BlockSpec((64, chunk), lambda k: (0, k), transforms=transforms),
                plgpu.BlockSpec((outputs, chunk), lambda k: (n, k), transforms=transforms)])(x_ref, w_ref)
            return acc_ref[...]
        o_smem[...] = pl.run_scoped(sums, plgpu.ACC((64, outputs), jnp.float32)).astype(o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, M)], o_ref.at[:, pl.ds(n * outputs, outputs)])
        plgpu.wait_smem_to_gmem(0)
    return kernel(x, w)


ROWS_FORMS = {"pallas_triton": rows_pallas_triton, "mosaic_gpu": rows_mosaic_gpu, "xla": rows_xla}


# --- timing ---------------------------------------------------------------------------------------

def add_norm_inputs(size: tuple[int, int], chain: int):
    """(the reference call's arguments, the chain's): a row, a delta and a norm weight, both."""
    args = tuple(jax.random.normal(jax.random.key(i), shape, jnp.bfloat16)
                 for i, shape in enumerate(((1, size[1]), (1, size[1]), (size[1],))))
    return args, args


def add_norm_chain(form, n: int):
    """n calls of `form` in one program, each on the previous one's outputs."""
    def run(x, d, g):
        for _ in range(n):
            x, d = form(x, d, g)
        return x, d
    return jax.jit(run)


def project_inputs(size: tuple[int, ...], chain: int):
    """(the reference call's arguments, the chain's): M rows (size (N, C): one; (M, N, C): M) and
    a matrix a call, alternately [N, C] and [C, N], scaled by 1/sqrt(fan-in) so that the rows keep
    their size along the chain."""
    M, N, C = (1, *size) if len(size) == 2 else size
    x = jax.random.normal(jax.random.key(0), (M, C), jnp.bfloat16)
    ws = [(jax.random.normal(jax.random.key(i + 1), (N, C) if i % 2 == 0 else (C, N), jnp.float32)
           / (C if i % 2 == 0 else N) ** 0.5).astype(jnp.bfloat16) for i in range(chain)]
    return (x, ws[0]), (x, ws)


def project_chain(form, n: int):
    """n calls of `form` in one program, each on the previous one's output and a matrix of its own."""
    def run(x, ws):
        for w in ws[:n]:
            x = form(x, w)
        return x
    return jax.jit(run)


# kernel: (its forms, calls in a timed program by default, its inputs, its chain)
KERNELS = {"add_norm": (FORMS, 100, add_norm_inputs, add_norm_chain),
           "project": (PROJECT_FORMS, 32, project_inputs, project_chain),
           "rows": (ROWS_FORMS, 16, project_inputs, project_chain)}


def device_time(run, args) -> float:
    """Seconds of kernel time on the device in one traced call of `run` (already compiled)."""
    import tempfile

    import jaxllm
    with tempfile.TemporaryDirectory() as d:
        with jaxllm.trace(d, perfetto=False):
            jax.block_until_ready(run(*args))
        return jaxllm.summarize(d, top=0).total_s


def measure(kernel: str, name: str, size: tuple[int, ...], chain: int, repeat: int,
            profile: bool = False) -> dict:
    """One JSON line: form `name` of `kernel` at `size` ((N, C), or rows' (M, N, C)), timed as
    `chain` calls; with `profile`, also the device's kernel time a call in a traced run."""
    forms, _, inputs, chained = KERNELS[kernel]
    N, C = size[-2:]
    line = dict(kernel=kernel, form=name, width=C, rows=N, batch=size[0] if len(size) == 3 else 1,
                chain=chain, us_per_call=None, gb_per_s=None,
                max_abs_err=None, device=jax.devices()[0].device_kind, jax_version=jax.__version__,
                available=True, error=None, **({"device_us_per_call": None} if profile else {}))
    try:
        args, chain_args = inputs(size, chain)
        got, want = jax.jit(forms[name])(*args), jax.jit(forms["xla"])(*args)
        got, want = (jax.tree.leaves(v) for v in (got, want))
        line["max_abs_err"] = max(float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max())
                                  for a, b in zip(got, want))
        run = chained(forms[name], chain)
        jax.block_until_ready(run(*chain_args))
        best = float("inf")
        for _ in range(repeat):
            t = time.perf_counter()
            jax.block_until_ready(run(*chain_args))
            best = min(best, time.perf_counter() - t)
        line["us_per_call"] = round(best / chain * 1e6, 3)
        if kernel != "add_norm":
            line["gb_per_s"] = round(N * C * 2 / (best / chain) / 1e9, 1)
        if profile:
            line["device_us_per_call"] = round(device_time(run, chain_args) / chain * 1e6, 3)
    except ImportError as e:
        line.update(available=False, error=f"{type(e).__name__}: {e}")
    except Exception as e:  # a form that fails to lower or compile on this JAX is a result too
        line["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    return line


def _sizes(text: str, parts: int) -> list[tuple[int, ...]] | None:
    """`--widths` ("C,...": parts 1, as (1, C)), `--shapes` ("NxC,...": 2) or `--rows-shapes`
    ("MxNxC,...": 3) as size tuples, None where malformed."""
    try:
        sizes = [tuple(int(v) for v in item.lower().split("x")) for item in text.split(",")]
    except ValueError:
        return None
    if not all(len(size) == parts and min(size) >= 1 for size in sizes):
        return None
    return [(1, *size) for size in sizes] if parts == 1 else sizes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernels", default="add_norm,project,rows",
                   help="a comma list of add_norm, project, rows (default: all)")
    p.add_argument("--widths", default="576,2048,4096", help="add_norm's row widths, a comma list (default: 576,2048,4096)")
    p.add_argument("--shapes", default="1536x576,576x1536,2048x2048,1024x4096",
                   help="project's matrices N x C, a comma list (default: SmolLM2's gate and down, "
                        "Llama-3.2-1B's q, a 4M-weight one)")
    p.add_argument("--rows-shapes", default="32x4096x4096,32x14336x4096,8x2048x2048",
                   help="rows' M rows x N x C, a comma list (default: 32 rows of the 8B shape's o and "
                        "gate, 8 of Llama-3.2-1B's q)")
    p.add_argument("--forms", default=None, help="a comma list of the kernels' forms (default: all)")
    p.add_argument("--chain", type=int, default=None,
                   help="calls in one timed program (default: add_norm 100, project 32, rows 16)")
    p.add_argument("--repeat", type=int, default=5, help="timed runs, the best kept (default: 5)")
    p.add_argument("--profile", action="store_true",
                   help="also trace one run of each chain: the device's kernel time a call")
    args = p.parse_args(argv)
    kernels = args.kernels.split(",")
    if unknown := [k for k in kernels if k not in KERNELS]:
        p.error(f"unknown kernel {unknown[0]!r}: choose from {', '.join(KERNELS)}")
    sizes = {"add_norm": _sizes(args.widths, 1), "project": _sizes(args.shapes, 2),
             "rows": _sizes(args.rows_shapes, 3)}
    if sizes["add_norm"] is None:
        p.error(f"--widths must be a comma list of integers >= 1, got {args.widths!r}")
    if sizes["project"] is None:
        p.error(f"--shapes must be a comma list of N x C pairs such as 2048x2048, got {args.shapes!r}")
    if sizes["rows"] is None:
        p.error(f"--rows-shapes must be a comma list of M x N x C such as 32x4096x4096, got {args.rows_shapes!r}")
    known = {f for k in kernels for f in KERNELS[k][0]}
    forms = args.forms.split(",") if args.forms else None
    if forms and (unknown := [f for f in forms if f not in known]):
        p.error(f"unknown form {unknown[0]!r}: choose from {', '.join(sorted(known))}")
    if (args.chain is not None and args.chain < 1) or args.repeat < 1:
        p.error("--chain and --repeat must be >= 1")
    if jax.default_backend() != "gpu":
        print(f"bench_backends: needs a CUDA GPU (JAX's backend here is {jax.default_backend()})", file=sys.stderr)
        return 2
    for kernel in kernels:
        for size in sizes[kernel]:
            for name in [f for f in KERNELS[kernel][0] if forms is None or f in forms]:
                line = measure(kernel, name, size, args.chain or KERNELS[kernel][1], args.repeat,
                               args.profile)
                print(json.dumps(line), flush=True)
                print(f"{kernel} {name:20s} {'x'.join(map(str, size))}: {line['us_per_call']} us a call"
                      + (f", {line['device_us_per_call']} in kernels" if args.profile else "")
                      + (f" ({line['error']})" if line["error"] else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
