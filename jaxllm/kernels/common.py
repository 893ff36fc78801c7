"""What the kernel families share: their mode under a switch, Hopper's early-launch signal (PDL),
the int8 -> float32 convert and the L2 prefetch, both as inline PTX, and small tile helpers."""

import jax
import jax.numpy as jnp

from jaxllm import runtime
from jaxllm.kernels.tuning import KernelTuning
from jaxllm.layers import dense as L

# Every family is written for Pallas' Triton backend, which JAX 0.11 deprecated: imported here
# only, so that a JAX without it (or one where it fails to import) still imports jaxllm, and the
# step plan takes XLA's forms instead (`mode`).
try:
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt
    TRITON_MISSING: str | None = None  # why the backend is unavailable, or None where it is not
except Exception as e:  # ImportError, or any error of a backend half removed
    pl = plt = None
    TRITON_MISSING = f"{type(e).__name__}: {e}".splitlines()[0]
# Pallas on Mosaic GPU, the backend the port off Triton goes to, family by family where a family's
# `*_backend` knob asks for it (docs/decisions/kernel-backends.md).
try:
    from jax.experimental.pallas import mosaic_gpu as plgpu
    MOSAIC_MISSING: str | None = None
except Exception as e:
    plgpu = None
    MOSAIC_MISSING = f"{type(e).__name__}: {e}".splitlines()[0]
# Mosaic GPU kernels in "interpret" mode run in Mosaic GPU's interpreter under these params, which
# JAX 0.10 names only under jax._src, which the package does not import: tests set them.
MOSAIC_INTERPRET = None


def mosaic_interpret(interpret: bool, family: str):
    """A Mosaic GPU kernel's `interpret` argument: False on a GPU, else `MOSAIC_INTERPRET` (a
    ValueError naming `family` where no test has set it)."""
    if not interpret:
        return False
    if MOSAIC_INTERPRET is None:
        raise ValueError(f"the Mosaic GPU {family} in interpret mode needs kernels.common.MOSAIC_INTERPRET "
                         "(Mosaic GPU's interpreter's params)")
    return MOSAIC_INTERPRET


NEG = -1e30  # an empty softmax's running maximum: finite, so exp(m - m) never forms inf - inf


def mode(switch: str, dtype, family: str, backend: str = "triton") -> str | None:
    """Kernel `family`'s mode under its switch ("auto", "xla" or "interpret"): with "auto", "gpu"
    for a float16/bfloat16 model on a GPU from Ampere on (bf16 tensor cores), else None (XLA's
    form; float32 models keep XLA's exact arithmetic). Where the family would run but its
    `backend` ("triton" or "mosaic_gpu") is unavailable, or is Mosaic GPU below Hopper, None
    too, after one warning a family and process."""
    if switch == "xla":
        return None
    if switch != "interpret" and (runtime.gpu_generation() < 8
                                  or jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16)):
        return None
    if backend == "mosaic_gpu" and switch != "interpret" and runtime.gpu_generation() < 9:
        runtime.fall_back(family, "its Mosaic GPU form needs a Hopper GPU or later")
        return None
    missing, name = (MOSAIC_MISSING, "Mosaic GPU") if backend == "mosaic_gpu" else (TRITON_MISSING, "Triton")
    if missing is not None:
        runtime.fall_back(family, f"the Pallas {name} backend is unavailable ({missing})")
        return None
    return "interpret" if switch == "interpret" else "gpu"


def pow2(n: int) -> int:
    """The least power of two >= n: a Triton tile's extent, its excess masked."""
    return 1 << (n - 1).bit_length()


# Hopper's programmatic dependent launch: ours signal at their start, so the next kernel's programs
# are resident, waiting, when this one ends (docs/decisions/one-row-projection.md#early-launch-of-the-next-kernel-pdl).
def pdl_trigger(interpret: bool, tuning: KernelTuning) -> bool:
    """Whether a kernel signals its dependents: on a GPU from Hopper on (griddepcontrol is sm_90)."""
    return tuning.pdl_trigger and not interpret and runtime.gpu_generation() >= 9


def launch_dependents(x):
    """The int32 scalar x, after griddepcontrol.launch_dependents (asm that returns x, so that the
    signal stays where x is made and is kept as long as x is used)."""
    (y,) = plt.elementwise_inline_asm(
        "griddepcontrol.launch_dependents;\nmov.b32 $0, $1;", args=[jnp.zeros((1,), jnp.int32) + x],
        constraints="=r,r", pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct((1,), jnp.int32)])
    return jnp.max(y)


def dot_t(a_MK, b_NK):
    """a @ b.T in float32 (a tensor-core dot of the contracted minor axes)."""
    return jax.lax.dot_general(a_MK, b_NK, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


# The gate activations the kernels compute: SwiGLU's silu, and Gemma's tanh GELU (GeGLU) as
# `layers.ACTIVATION` writes it (its float32 arithmetic, here on float32 values).
GATES = ("silu", "gelu_tanh")


def swiglu(gate, up, dtype, activation: str = "silu"):
    """act(gate) * up in float32, from float32 sums, rounded as `layers.mlp` rounds it: the
    products in the model's dtype, then act(gate) in it; act silu (SwiGLU) or, with `activation`
    "gelu_tanh", tanh GELU (Gemma's GeGLU)."""
    gate, up = (y.astype(dtype).astype(jnp.float32) for y in (gate, up))
    if activation == "silu":
        return (gate * jax.nn.sigmoid(gate)).astype(dtype).astype(jnp.float32) * up
    return L.ACTIVATION[activation](gate).astype(dtype).astype(jnp.float32) * up


def power_of_2(n):
    """2^n in float32 for integer n in [-126, 127], exactly (the exponent field)."""
    return jax.lax.bitcast_convert_type((n + 127) << 23, jnp.float32)


# int8 -> float32 by two full-rate instructions a value: each byte, offset to u = q + 128, is
# permuted into the low byte of 0x4B000000, the float 2^23 (a 23-bit mantissa), giving the float
# 2^23 + u exactly; subtracting 2^23 + 128 leaves q. Four values a 32-bit register.
_INT8_ASM = """{
.reg .b32 u;
xor.b32 u, $4, 0x80808080;
prmt.b32 $0, u, 0x4B000000, 0x7440;
prmt.b32 $1, u, 0x4B000000, 0x7441;
prmt.b32 $2, u, 0x4B000000, 0x7442;
prmt.b32 $3, u, 0x4B000000, 0x7443;
}"""


def to_f32(w, permute: bool):
    """A loaded weight tile as float32; int8 through `_INT8_ASM` when `permute` (GPU only)."""
    if not (permute and w.dtype == jnp.int8):
        return w.astype(jnp.float32)
    (bits,) = plt.elementwise_inline_asm(
        _INT8_ASM, args=[w], constraints="=r,=r,=r,=r,r", pack=4,
        result_shape_dtypes=[jax.ShapeDtypeStruct(w.shape, jnp.int32)])
    return jax.lax.bitcast_convert_type(bits, jnp.float32) - (2.0**23 + 128)


# L2 prefetch: `project`'s kernel asks L2 for the next projection's small matrix once its own sums
# are made, with Hopper's bulk prefetch (cp.async.bulk.prefetch.L2) or a line at a time
# (docs/decisions/one-row-projection.md#l2-prefetch-of-the-next-matrix). Pallas has no prefetch and
# its refs' addresses are not values: its public inline asm, given a one-element block of the
# matrix, receives the matrix's address (docs/decisions/one-row-projection.md#the-asks-form).
PREFETCH_PIECE = 4096  # the least bytes one lane asks for
# Lane t of program p (of P) asks for piece t*A + p - (P - A), A this many times the
# multiprocessors (or P): each piece asked once in every A-th program, the last among the last A.
PREFETCH_STRIDE_PER_MULTIPROCESSOR = 2
# Where a layer's weights come from HBM (not `weights_first`), the kernel asks a line at a time
# (prefetch.global.L2::evict_last): the bulk copy holds the asking kernel open until what it asked
# for has come, a line asked for does not.
PREFETCH_LINE_COUNT = 16  # lines one lane asks for, at most: a matrix needing more is not asked for


def can_prefetch() -> bool:
    """Whether kernels can ask L2 for a matrix here: a GPU from Hopper on, the Triton backend there."""
    return TRITON_MISSING is None and runtime.gpu_generation() >= 9


def prefetch_pieces(nbytes: int, programs: int, lanes: int, lines: bool) -> tuple[int, int] | None:
    """How the asks for `nbytes` are dealt: (stride, piece bytes) with lane t of program p (of
    `programs`) asking for piece q = t*stride + p - (programs - stride), or None where nothing is
    asked (a line at a time, a matrix needing more than PREFETCH_LINE_COUNT lines a lane)."""
    if lines:  # pieces of whole lines, every program's lanes sharing the matrix
        piece = -(-nbytes // (programs * lanes * 128)) * 128
        return None if piece > 128 * PREFETCH_LINE_COUNT else (programs, piece)
    stride = min(programs, PREFETCH_STRIDE_PER_MULTIPROCESSOR * runtime.multiprocessors())
    return stride, max(PREFETCH_PIECE, -(-nbytes // (stride * lanes)) // 16 * 16 + 16)


def prefetch_asm(nbytes: int, programs: int, stride: int, piece: int, lines: bool) -> str:
    """The ask's PTX: this lane's piece (lane %tid.x of program $2, as `prefetch_pieces`
    deals them) of the matrix at address $1, by Hopper's bulk prefetch or, with `lines`, a line
    at a time; $3, the float the program made, only orders it. Returns 0 in $0."""
    ask = ("setp.ne.s32 p, c, 0;\n@p cp.async.bulk.prefetch.L2.global [a], c;\n" if not lines else
           "".join(f"setp.gt.s32 p, c, {128 * i};\n@p prefetch.global.L2::evict_last [a+{128 * i}];\n"
                   for i in range(piece // 128)))
    return ("{\n.reg .pred p;\n.reg .s32 t, q, c;\n.reg .s64 o, a;\n"
            "mov.u32 t, %tid.x;\n"
            f"mad.lo.s32 q, t, {stride}, $2;\n"
            f"sub.s32 q, q, {programs - stride};\n"  # q < 0: no piece
            f"mul.lo.s32 c, q, {-piece};\n"
            f"add.s32 c, c, {nbytes};\n"  # what is left of the matrix from piece q
            f"min.s32 c, c, {piece};\n"
            "max.s32 c, c, 0;\n"
            "setp.lt.s32 p, q, 0;\n"
            "selp.s32 c, 0, c, p;\n"
            f"mul.wide.s32 o, q, {piece};\n"
            "add.s64 a, $1, o;\n"
            + ask + "mov.b32 $0, 0;\n}")


def prefetch(ref, nbytes: int, programs: int, lanes: int, after, lines: bool = False):
    """Ask L2 for the first `nbytes` of the flat matrix behind `ref` (a one-element block at its
    start: its address is all the asm takes), in pieces dealt to the lanes of the kernel's
    `programs` (`prefetch_pieces`); `after`, a float the program computed, holds the asks back
    until it is made. With `lines`, a line at a time, each piece asked for once, by one lane of
    one program. Pallas' inline asm is pure: the ask returns an int32 [1] of zeros that the kernel
    must fold into what it stores, or the ask goes with the unused value; None where nothing is
    asked."""
    dealt = prefetch_pieces(nbytes, programs, lanes, lines)
    if dealt is None:
        return None
    (zero,) = plt.elementwise_inline_asm(
        prefetch_asm(nbytes, programs, *dealt, lines), constraints="=r,l,r,f", pack=1,
        args=[ref, jnp.zeros((1,), jnp.int32) + pl.program_id(0), jnp.zeros((1,), jnp.float32) + after],
        result_shape_dtypes=[jax.ShapeDtypeStruct((1,), jnp.int32)])
    return zero
