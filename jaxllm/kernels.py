"""Pallas (Triton) kernels for the GPU decode step, where XLA's own fusions cost too many launches.

Measured on an H200 (bench traces, batch 1): a decode layer ran 17 kernels, and the 9 of them
between the qkv and o projections (rotary, two cache writes, scores, two softmax reductions, a
convert, the weighted sum, a concatenate) took 1-3 us each however small their work: 12 us of the
8B shape's 126 us layer and most of SmolLM2's 28 us one. `decode_attention` does that span in
one kernel (plus a small combine when the cache is split over programs; grids that fill the
GPU unsplit take one split, `ONE_SPLIT_VALUES`), and reads only each row's live slots, where
XLA's masked form reads the whole cache. In a chain of 32 layers on the H200: 8.2 us a layer
against XLA's 11.3 (8B shape, batch 1, cache 384), 6.3 against 9.5 (SmolLM2), 19.3 against
24.6 (8B, batch 32), 12.3 against 23.4 (8B, cache 8448 with 500 live).
`project` folds a layer's norms and epilogues into its matrix-vector products for the same
reason, and also takes large int8 matrices, which it converts faster than XLA (`INT8_CONVERT`);
their norms go through `add_norm` instead (`INT8_NORM_APART`), which also writes the normed row
as int8 digits for the tensor-core kernel of a large int8 gate/up or lm_head (`INT8_DIGITS`);
gate/up's kernel writes its output's digits so for the down projection (`INT8_DOWN_DIGITS`).
On Hopper each kernel lets the next one launch as it starts (`PDL_TRIGGER`), and `project`'s
asks L2 for the next projection's matrix where it is small (`PREFETCH_MAX_BYTES`); where a
layer's matrices all come from L2 so, its kernels load their weights before their input
(`WEIGHTS_FIRST`), and where they do not, they ask a line at a time (`PREFETCH_LINES`); a
gate/up that is not asked for takes programs twice as wide (`GATE_UP_WIDE`); in a float matrix's
kernel the norm's sum of squares waits until after the products (`SQUARES_LAST`).
A decode step of 8-32 rows (under 32 only for large matrices) takes `rows_project`, tensor-core
products with their bias, residual or SwiGLU, where XLA ran those as fusions of their own. A MoE
layer's routing (softmax and top-k) is one kernel, `route`.
"""

import functools
import math

import jax
import jax.numpy as jnp
from flax import struct
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxllm.env import env_choice, env_flag, env_ints, env_number
from jaxllm.layers import dense as L
from jaxllm.layers.quant import QuantizedWeight, stored

# "auto": the Pallas kernel on a GPU where `decode_attention_mode` allows, else XLA's masked form;
# "xla" never the kernel; "interpret" the kernel in Pallas' interpreter (tests on the CPU).
# The kernel switches below take these values (any other is a ValueError at import).
MODES = ("auto", "xla", "interpret")
DECODE_ATTENTION = env_choice("JAXLLM_DECODE_ATTENTION", MODES, "auto")
# Tiles: cache slots per loop iteration (at most; a cache length's power-of-two factor), cache
# slots per program (longer caches split over programs, combined after), warps per program.
# 32,128,4 had the lowest total of five tile sets over the five cases above (64,1024,4: 25% more).
# Blocks of 64 then beat it at batch 1 (a small grid's half-length splits, below, each one block):
# on an H200 (bench, prompt 128 + 256 new, same run) Qwen3-0.6B 0.6835 ms a step against 0.6981 and
# 0.6956 (0.6706-0.6748 on other machines), SmolLM2 0.4301 against 0.4426, Llama-3.2-1B 0.8087
# against 0.8173, the 8B shape in int8 2.6624 against 2.6716 and in bf16 3.8779 against 3.8814; at
# batch 32 4.8067 against 4.8013, at context 8192 4.2096 against 4.2229 (unchanged). Of other sets
# at Qwen3-0.6B, every one with fewer splits lost (0.763-0.810 ms: 128,256,8 with one 128-slot
# block a split, its heads combined in o's kernel; 128,1024,8 with one split of three blocks), and
# 64,128,8 and 64,128,2 too (0.689, 0.711). So did, at 64,128,4, asking for the split's block
# before the new token's q and k are made (Qwen3-0.6B 0.694 against 0.671, SmolLM2 0.469 against
# 0.430) and making the rotation's cos and sin in each program rather than once a step in XLA
# (0.721, 0.449). JAXLLM_DECODE_TILES="block,split,warps" overrides the tiles for benchmarking.
BLOCK_SLOTS, SPLIT_SLOTS, WARPS = env_ints("JAXLLM_DECODE_TILES", "64,128,4")
# A grid of fewer programs than the GPU has multiprocessors takes half-length splits: each
# program's loop is then shorter, which beat the larger combine after it. End to end on an H200
# (bench, batch 1, prompt 128 + 256 new, 32,64 against 32,128 in one run): SmolLM2 0.557 against
# 0.606 ms/step, the 8B shape 4.02 against 4.06; Qwen3-0.6B 0.723 against 0.782 (two runs).
# Where the grid is already large, half splits lost: 8B batch 32 4.97 against 4.91, 8B at
# context 8192 4.60 against 4.45. MULTIPROCESSORS (an H100's or H200's count) stands in where
# the device does not say, as on a CPU.
MULTIPROCESSORS = 132
# A grid whose (row, KV head) programs alone hold at least ONE_SPLIT_VALUES head values (B*K*H)
# a multiprocessor takes one split: each program streams its row's whole live cache, and no
# combine kernel runs after it (1.5 us of an 8B layer's 137 at batch 32, H200 trace). On an H200
# (bench, prompt 128 + 256 new, --repeat 2, same runs, one split against the splits above; B*K
# programs x H values, against the bound's 192 x 132 = 25344): the 8B shape at batch 32 (256 x
# 128) 4.7129, 4.7108 and 4.7063 ms a step against 4.745, 4.7536 and 4.745; at context 2048
# 6.7057 against 6.9617; at batch 64 5.6493 against 5.7673; Qwen3-0.6B at batch 32 (256 x 128)
# 1.3098 and 1.3068 against 1.3393 and 1.3357. Below the bound it lost or broke even:
# Llama-3.2-1B at batch 32 (256 x 64) 1.1245 and 1.1202 against 1.1022 and 1.1026, at context
# 2048 1.9473 against 1.7119; the 8B shape at batch 24 (192 x 128) 4.6288, 4.6156 and 4.6166
# against 4.621, 4.6236 and 4.6253. Our reading: a program's loop keeps two blocks of its head's
# keys and values in flight, so fewer or narrower heads leave a multiprocessor too few bytes in
# flight without the splits' extra programs.
# The tiles above stay (the 8B shape at batch 32, one run: 4.5918 and 4.6014 ms; 128-slot
# blocks 4.6161, 8 warps 4.6109, 32-slot blocks 4.6687; Qwen3-0.6B 1.311 against 1.3407 in
# 128-slot blocks), and so do the two stages: three lost (another run: the 8B shape at batch 32
# 4.7349 against 4.7016, at context 2048 6.6999 against 6.6716, Qwen3-0.6B 1.3231 against
# 1.3142; Llama-3.2-1B in one split and three stages 1.1259 against 1.1106 split).
# JAXLLM_DECODE_ONE_SPLIT overrides the bound for benchmarking (0: always the splits above).
ONE_SPLIT_VALUES = env_number("JAXLLM_DECODE_ONE_SPLIT", 192)
QUERY_ROWS = 16  # the query tile: a KV head's G queries, padded to the smallest tensor-core dot
_NEG = -1e30  # an empty softmax's running maximum: finite, so exp(m - m) never forms inf - inf


def decode_attention_mode(dtype, head_dim: int, rotary_dim: int, kv_int8: bool,
                          cache_length: int) -> str | None:
    """"gpu", "interpret" or None (XLA's form): whether a decode step's attention takes the kernel.

    The kernel wants a float16/bfloat16 model (float32 models keep XLA's exact form), the whole
    head rotated (its halves power-of-two sized), a cache in the model dtype, and a cache length
    that is a multiple of 16 (its blocks of slots are tensor-core dot operands; `generate`'s
    bucketed lengths always are, a hand-made cache may not be).
    """
    if kv_int8 or rotary_dim != head_dim or cache_length % 16:
        return None
    if head_dim % 2 or (head_dim // 2) & (head_dim // 2 - 1) or head_dim < 16:
        return None
    mode = _mode(DECODE_ATTENTION, dtype)
    if mode == "gpu" and head_dim < 32:  # tensor-core dots contract at least 16 (half a head)
        return None
    return mode


def _mode(switch: str, dtype) -> str | None:
    """A kernel's mode under its switch ("auto", "xla" or "interpret"): with "auto", "gpu" for a
    float16/bfloat16 model on a GPU from Ampere on (bf16 tensor cores), else None (XLA's form;
    float32 models keep XLA's exact arithmetic)."""
    if switch in ("xla", "interpret"):
        return None if switch == "xla" else "interpret"
    if L.gpu_generation() < 8 or jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        return None
    return "gpu"


def _multiprocessors() -> int:
    """The default device's multiprocessor count, or MULTIPROCESSORS where it does not say."""
    return getattr(jax.devices()[0], "core_count", None) or MULTIPROCESSORS


def _pow2(n: int) -> int:
    """The least power of two >= n: a Triton tile's extent, its excess masked."""
    return 1 << (n - 1).bit_length()


def _block(length: int) -> int:
    return min(BLOCK_SLOTS, length & -length)


# Hopper's programmatic dependent launch (PDL): XLA launches the kernels of a program so that each
# may start before the one ahead of it has ended, and has each wait (griddepcontrol.wait) at its
# start until that one has finished and its writes are visible. Without a signal the next kernel
# starts as this one's programs exit; ours signal at their start (griddepcontrol.launch_dependents),
# so the next kernel's programs are resident, waiting, when this one ends. On an H200 (bench,
# batch 1, same run, two rounds): SmolLM2 0.4769 and 0.4770 ms a step against 0.5010 and 0.5015,
# Qwen3-0.6B 0.733 and 0.730 against 0.737 and 0.732; Llama-3.2-1B and the 8B shape in int8
# unchanged. XLA's own PDL (--xla_gpu_enable_pdl, on by default) matters more: off, Qwen3-0.6B
# took 0.762 ms against 0.728 and Llama-3.2-1B 0.859 against 0.836. JAXLLM_PDL_TRIGGER=0 turns
# the signal off.
PDL_TRIGGER = env_flag("JAXLLM_PDL_TRIGGER", True)


def _pdl_trigger(interpret: bool) -> bool:
    """Whether a kernel signals its dependents: on a GPU from Hopper on (griddepcontrol is sm_90)."""
    return PDL_TRIGGER and not interpret and L.gpu_generation() >= 9


def _launch_dependents(x):
    """The int32 scalar x, after griddepcontrol.launch_dependents (asm that returns x, so that the
    signal stays where x is made and is kept as long as x is used)."""
    (y,) = plt.elementwise_inline_asm(
        "griddepcontrol.launch_dependents;\nmov.b32 $0, $1;", args=[jnp.zeros((1,), jnp.int32) + x],
        constraints="=r,r", pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct((1,), jnp.int32)])
    return jnp.max(y)


# A decode step whose output projection takes `project`'s kernel gets the attention's cache
# splits uncombined (`SplitHeads`), and each of the projection's programs combines them as it
# loads its input: no combine kernel (1.1-1.3 us of a SmolLM2 layer's 18 on an H200), but every
# program holds all splits' sums in registers. So only where those are at most this many values
# (splits and K*G, each to a power of two, times H): SmolLM2 (6 splits, 8 x 16 x 64) ran 0.538
# ms a step against 0.553 with XLA's combine; at 8 x 16 x 128 Qwen3-0.6B lost (0.742 against
# 0.725), at 8 x 32 x 64 Llama-3.2-1B more (0.936 against 0.865); with 8 warps for those tiles
# Qwen3-0.6B broke even (0.736 against 0.744) and Llama-3.2-1B still lost (0.913 against 0.863).
# Above it XLA combines them and the kernel still projects, where it takes the matrix: the 8B
# shape in int8 2.925 and 2.931 ms a step against 2.953 and 2.968 with XLA's product and residual
# add too, Llama-3.2-1B 0.821 and 0.824 against 0.825 and 0.824 (H200, same run).
# JAXLLM_FUSED_HEADS overrides the limit for benchmarking (0: always XLA's combine).
FUSED_HEADS_VALUES = env_number("JAXLLM_FUSED_HEADS", "8192")


@struct.dataclass
class SplitHeads:
    """A decode step's attention output with its cache splits P not yet combined: unnormalized
    weighted sums acc [B, P, K, G, H] and the softmax's running maxima m and denominators l
    [B, P, K, G], all float32; `dtype` is the heads' once combined."""
    acc: jax.Array
    m: jax.Array
    l: jax.Array
    dtype: jnp.dtype = struct.field(pytree_node=False)

    def combined(self) -> jax.Array:
        """[B, K, G, H]: each split weighted by exp(m - the largest m), over the summed weights."""
        w_BPKG = jnp.exp(self.m - jnp.max(self.m, axis=1, keepdims=True))
        return (jnp.sum(self.acc * w_BPKG[..., None], axis=1)
                / jnp.sum(self.l * w_BPKG, axis=1)[..., None]).astype(self.dtype)


# The gate/up matrix of a large int8 SwiGLU (one in INT8_TILES, its norm apart) and an int8
# lm_head past KERNEL_MAX_INT8_WEIGHTS (XLA's otherwise) take a tensor-core kernel: `add_norm`
# writes the normed row x also as DIGITS int8 digits of base 256 with one float32 factor
# (`DigitRow`), x = factor * sum_d digit_d 256^d exactly (to 2^-30 of its largest magnitude,
# where float32 sums round at 2^-24), and each program multiplies its int8 weights by the digits
# as tensor-core int8 products (mma, exact int32 sums), with no conversion of the weights at
# all; the digit rows are the product's 16 rows, those past DIGITS never read (masked). Chains
# of 8 of the 8B shape's matrices on an H200, us a matrix against `project`'s kernel (norm
# apart): gate/up 31.0-31.7 against 33.9-34.1 (tiles 64 or 32 rows of 256 channels, 4 warps, 3
# stages), qkv 11.7-14.5 against 13.2-15.2 (16 or 32 rows), down 18.4-18.6 against 22.0-22.6,
# o 9.3-9.9 against 8.9-10.1. End to end (bench, 8B int8, one run): gate/up so 2.5789 ms a step
# against 2.6397 and 2.6377 without; qkv too 2.6751 and 2.6766, qkv alone 2.6937 (it lost end
# to end what its chains won; why, I did not find); both with add_norm in 16 warps
# (ADD_NORM_DIGIT_WARPS; the digits are its extra work) 2.627. gate/up alone, landed first
# (add_norm in 16 warps; another machine, same run): 2.5640 and 2.5599 ms a step against 2.6223
# and 2.6175 (390 tok/s against 382). The lm_head then (525M weights, 3.65 TB/s in XLA's
# reduction; one same-run set, 64 rows of 256): 2.5383 ms a step against 2.5711 and 2.5609
# without; in another run 2.5315 and 2.5504 against 2.5726 (392-395 tok/s against 389-391);
# as landed, on another machine, 2.5227 and 2.5157 against 2.5453 and 2.5469 (397 against 393);
# its tiles 64 rows of 1024, 32 of 1024 and 128 of 256 gave 2.5461, 2.5444 and 2.5446, 4
# stages 2.5421, 8 warps 2.5442, chunks of 512 2.5333. qkv at larger tiles lost still: 32 rows
# of 1024 channels 2.5833 against 2.5711 and 2.5609 (512: 2.5936, 16 rows of 1024 2.6749, 64
# of 512 2.5902, 32 of 256 2.6279). gate/up's other tiles, with the lm_head's: 32 rows 2.5494, 4
# stages 2.5674, chunks of 512 2.5807, 8 warps 2.5619, 128 rows of 128 2.6593, against 2.5315
# and 2.5504 (add_norm in 8 warps 2.5537, 4 warps 2.5595). o cannot take digits: its input comes
# from the attention's many programs, none of which can make the row's one factor. down took
# gate/up's output as digits with a factor for each program's block of 64 channels, each
# block's int32 products scaled into float32 sums as they came, and lost badly: 3.2035 and
# 3.2039 ms a step against 2.5528 and 2.5562 (32 rows, chunks of 512; 3.1806 in chunks of 256,
# 4.1385 in 16 rows; same run, gpu_check passing; that code is not kept). down making the row's
# digits itself in each program (the row's largest magnitude from a first pass over it, then
# each chunk's digits in registers before its product; gpu_check passing) lost too: 3.1959 ms
# a step against 2.5654 in chunks of 256, 2.8499 in 512, 2.633 and 2.646 in 1024 (a chunk of
# the row loaded one step ahead) against 2.565-2.574, 2.7212 in 16 rows of 2048; not kept. Nor
# did down from digits that a one-program kernel made of gate/up's output, through this kernel
# (gpu_check passing): 2.9167 and 2.9012 ms a step against 2.5474 and 2.5575 in 32 rows of 256
# channels, 3 stages; 16 rows 2.9013, 64 rows 2.978, chunks of 512 2.6816, of 1024 2.613; with
# more stages (so more bytes in flight) 2.5901 (256 channels, 8 stages), 2.594 (12), 2.5651 and
# 2.5673 (512, 5 and 7 stages), 2.5695 (1024, 4), against 2.5482 on the same machine. So its
# chains' 18.4-18.6 us did not carry over, as qkv's did not, until gate/up's kernel wrote the
# digits itself (INT8_DOWN_DIGITS, below).
# JAXLLM_INT8_DIGITS=0 turns it off, JAXLLM_INT8_HEAD_DIGITS=0 for the lm_head only;
# JAXLLM_INT8_DIGIT_TILES and JAXLLM_INT8_HEAD_DIGIT_TILES ("rows,chunk,warps,stages": rows of
# each of gate and up, or of the lm_head, a program; channels a loop step) override the tiles
# for benchmarking.
INT8_DIGITS = env_flag("JAXLLM_INT8_DIGITS", True)
INT8_HEAD_DIGITS = env_flag("JAXLLM_INT8_HEAD_DIGITS", True)
DIGITS = 4
# The down projection takes the same kernel, from digits that gate/up's kernel writes of its
# output (INT8_DOWN_DIGITS): no pass of its own, where making them from the output's largest
# value lost every way (above). The unit is set by a bound on the output that every program
# knows at once instead: `down_bounds` (127^2 and the largest gate and up scales, once a step
# for all layers) times the squared sum of magnitudes of the normed row, which `add_norm` adds
# up. The bound is loose (every weight at 127, every product adding up), so the digits are
# five (40 bits, the unit at most 2^-36 of the bound): a value is off by less than the unit,
# and values far above it are exact. On an H200 (bench, the 8B shape in int8, batch 1,
# --repeat 2, one run): 2.4881, 2.4883 and 2.4944 ms a step (401.9, 401.9 and 400.9 tok/s)
# against 2.5591 and 2.5650 without (390.8 and 389.9); in another run 2.4903 against 2.5643
# and 2.5542; as landed, on a slower machine, 2.4901 and 2.4912 against 2.5482. Tiles (rows of
# down a program, channels a loop step, warps, stages): 32,512,4,7 as above, 6 stages 2.4886,
# 8 stages 2.5021, 5 stages 2.6483 and 2.6547 (why so much slower, I did not find),
# 32,1024,4,4 2.5041, 32,1024,4,5 2.5251, 16,512,4,7 2.598, 8 warps 2.6078, 32,256,4,8 2.6859.
# Only where down's programs (its rows over the tile's) are at least 3/4 of the
# multiprocessors: Llama-3.2-1B's down (2048 rows, 64 programs; only its last layer's, the
# others adding the residual for a next qkv that folds its norm) took 0.6346 ms a step against
# 0.6214 without (same run), where the 8B shape's (128 programs) took 2.4718 and 2.4748 against
# 2.5538 and 2.5443; 3/4 is a line drawn between those two, no count between them measured.
# With the rule (`source` bab3aa4239c3, same run): Llama-3.2-1B 0.6284 and 0.6229 against
# 0.6273, the 8B shape 2.4914 and 2.4884 against 2.5534. JAXLLM_INT8_DOWN_DIGITS=0 keeps down in
# `project`'s kernel; JAXLLM_INT8_DOWN_DIGIT_TILES sets its tiles.
INT8_DOWN_DIGITS = env_flag("JAXLLM_INT8_DOWN_DIGITS", True)
DOWN_DIGITS = 5
DOWN_DIGIT_TILES = env_ints("JAXLLM_INT8_DOWN_DIGIT_TILES", "32,512,4,7")
DIGIT_ROWS = 16  # a tensor-core product's fewest rows: the digits, then rows never read
DIGIT_TILES = env_ints("JAXLLM_INT8_DIGIT_TILES", "64,256,4,3")
HEAD_DIGIT_TILES = env_ints("JAXLLM_INT8_HEAD_DIGIT_TILES", "64,256,4,3")


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


@functools.partial(jax.jit, static_argnames=("window", "eps", "interpret", "split_out"))
def decode_attention(qkv_BKJH, k_BKSH, v_BKSH, end_B, start_B, rotation_P2R, *,
                     window: int | None = None, q_norm_H=None, k_norm_H=None, eps: float = 1e-6,
                     interpret: bool = False, split_out: bool = False):
    """One new token per row, in one kernel: rotate its q and k, write k and v at the row's slot
    end_b, and attend over the row's live slots (start_b .. end_b, the last `window` if given).
    Each row takes its own end, as its own start (`cache.KVCache`: rows end where they may).

    qkv [B, K, G+2, H] is the projection's output per KV head (G queries, then k, then v), before
    the optional per-head RMSNorm (Qwen3's q_norm/k_norm, [H]) and the rotation, whose cos and sin
    (float32, any attention factor included) the kernel takes from a table by position,
    [positions, 2, H/2] (`model.rotation_table`; row b's new token sits at position
    end_b - start_b), which `generate` makes once before its loop. The caches [B, K, S, H]
    are updated in place (their buffers aliased to the outputs). Returns (out [B, K, G, H], k, v);
    with `split_out`, out is a `SplitHeads` when the cache took more than one split.
    Scores, softmax and the weighted sum run in float32. Jitted, so the layers of a model share
    one lowering of the kernel.
    """
    B, K, J, H = qkv_BKJH.shape
    S = k_BKSH.shape[2]
    G, R = J - 2, H // 2
    rows = max(QUERY_ROWS, _pow2(G))
    block = _block(S)
    cdiv = lambda a, b: -(-a // b)
    if ONE_SPLIT_VALUES and B * K * H >= ONE_SPLIT_VALUES * _multiprocessors():
        slots = S
    else:
        slots = SPLIT_SLOTS if B * K * cdiv(S, SPLIT_SLOTS) >= _multiprocessors() else SPLIT_SLOTS // 2
    splits = cdiv(S, slots)
    span = cdiv(cdiv(S, splits), block) * block  # slots per split, a whole number of blocks
    splits = cdiv(S, span)
    qk_norm = q_norm_H is not None
    kernel = functools.partial(_decode_attention_kernel, G=G, R=R, window=window, span=span,
                               block=block, splits=splits, eps=eps, qk_norm=qk_norm, P=rows,
                               trigger=_pdl_trigger(interpret))
    row = lambda *block_shape: pl.BlockSpec(block_shape, lambda b, k, s: (b,) + (0,) * (len(block_shape) - 1))
    head = lambda *block_shape: pl.BlockSpec((None, None, *block_shape), lambda b, k, s: (b, k, 0, 0))
    vector = pl.BlockSpec((H,), lambda b, k, s: (0,))
    rotation_P2R = rotation_P2R.reshape(rotation_P2R.shape[0], 2 * R)  # a row per position
    in_specs = [row(1), row(1),
                pl.BlockSpec(rotation_P2R.shape, lambda b, k, s: (0, 0)),
                head(J, H), head(S, H), head(S, H)] + [vector, vector] * qk_norm
    args = [end_B.astype(jnp.int32), start_B.astype(jnp.int32),
            rotation_P2R.astype(jnp.float32), qkv_BKJH, k_BKSH, v_BKSH]
    args += [q_norm_H, k_norm_H] * qk_norm
    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct((B, K, G, H), qkv_BKJH.dtype)]
        out_specs = [head(G, H)]
    else:  # per split: unnormalized sums, running maxima and denominators (see SplitHeads)
        split = lambda *block_shape: pl.BlockSpec((None, None, None, *block_shape),
                                                  lambda b, k, s: (b, s, k) + (0,) * len(block_shape))
        out_shape = [jax.ShapeDtypeStruct((B, splits, K, G, H), jnp.float32),
                     jax.ShapeDtypeStruct((B, splits, K, G), jnp.float32),
                     jax.ShapeDtypeStruct((B, splits, K, G), jnp.float32)]
        out_specs = [split(G, H), split(G), split(G)]
    n_out = len(out_shape)
    out_shape += [jax.ShapeDtypeStruct(k_BKSH.shape, k_BKSH.dtype),
                  jax.ShapeDtypeStruct(v_BKSH.shape, v_BKSH.dtype)]
    out_specs += [head(S, H), head(S, H)]
    outs = pl.pallas_call(
        kernel, grid=(B, K, splits), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        input_output_aliases={4: n_out, 5: n_out + 1},
        compiler_params=plt.CompilerParams(num_warps=WARPS, num_stages=2),
        interpret=interpret, name="decode_attention")(*args)
    k_BKSH, v_BKSH = outs[n_out:]
    if splits == 1:
        return outs[0], k_BKSH, v_BKSH
    heads = SplitHeads(*outs[:n_out], dtype=qkv_BKJH.dtype)
    if split_out:
        return heads, k_BKSH, v_BKSH
    return heads.combined(), k_BKSH, v_BKSH


def _dot_t(a_MK, b_NK):
    """a @ b.T in float32 (a tensor-core dot of the contracted minor axes)."""
    return jax.lax.dot_general(a_MK, b_NK, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _decode_attention_kernel(end_ref, start_ref, rotation_ref, qkv_ref, k_ref, v_ref, *refs,
                             G, R, window, span, block, splits, eps, qk_norm, P, trigger):
    """One (row, KV head, split of the cache) program; see `decode_attention`.

    The G queries of the KV head sit in a tile of P >= 16 rows (the rest masked), so scores and
    the weighted sum are two tensor-core dots per block of slots, and the softmax two row
    reductions: written per query with vector reductions, the kernel took 20-28 us a layer.
    """
    if qk_norm:
        q_norm_ref, k_norm_ref, *refs = refs
    else:
        q_norm_ref = k_norm_ref = None
    out_refs, (k_out_ref, v_out_ref) = refs[:-2], refs[-2:]
    f32, dtype = jnp.float32, qkv_ref.dtype
    H = 2 * R
    part = pl.program_id(2)
    end, start = end_ref[0], start_ref[0]  # this row's write slot and first live slot
    if trigger:
        end = _launch_dependents(end)
    lo = start if window is None else jnp.maximum(start, end + 1 - window)
    at = jnp.maximum(end - start, 0)  # the new token's position (left padding clamped to 0)
    cos, sin = rotation_ref[pl.ds(at, 1), pl.ds(0, R)], rotation_ref[pl.ds(at, 1), pl.ds(R, R)]
    is_query = jnp.arange(P) < G

    def rotated(x1, x2, norm_ref):  # float32 [rows, R] halves, normed (Qwen3) and rotated
        if norm_ref is not None:  # as layers.rms_norm: normalize in float32, weight in the dtype
            inv = jax.lax.rsqrt((jnp.sum(x1 * x1, axis=1) + jnp.sum(x2 * x2, axis=1)) / H + eps)
            x1 = ((x1 * inv[:, None]).astype(dtype) * norm_ref[pl.ds(0, R)][None, :]).astype(f32)
            x2 = ((x2 * inv[:, None]).astype(dtype) * norm_ref[pl.ds(R, R)][None, :]).astype(f32)
        return x1 * cos - x2 * sin, x2 * cos + x1 * sin

    def query_half(at):
        return plt.load(qkv_ref.at[pl.ds(0, P), pl.ds(at, R)], mask=is_query[:, None], other=0).astype(f32)

    q1, q2 = (half.astype(dtype) for half in rotated(query_half(0), query_half(R), q_norm_ref))
    row = lambda j, at: qkv_ref[pl.ds(j, 1), pl.ds(at, R)].astype(f32)
    k1, k2 = (half.astype(k_ref.dtype) for half in rotated(row(G, 0), row(G, R), k_norm_ref))
    v = qkv_ref[pl.ds(G + 1, 1), :].astype(v_ref.dtype)
    owner = end // span == part  # the split holding the new token writes and counts it

    @pl.when(owner)
    def _():
        k_out_ref[pl.ds(end, 1), pl.ds(0, R)] = k1
        k_out_ref[pl.ds(end, 1), pl.ds(R, R)] = k2
        v_out_ref[pl.ds(end, 1), :] = v

    scale = H ** -0.5
    # 1.0 or 0.0 from integers: Pallas' Triton lowering took a bool -> float convert for a no-op.
    owned = (1 - jnp.minimum(jnp.abs(end // span - part), 1)).astype(f32)
    new_score = (jnp.sum(q1.astype(f32) * k1.astype(f32), axis=1)
                 + jnp.sum(q2.astype(f32) * k2.astype(f32), axis=1)) * scale
    m = jnp.where(owner, new_score, _NEG)
    l = jnp.zeros((P,), f32) + owned
    acc = jnp.zeros((P, H), f32) + v.astype(f32) * owned

    # The cached slots of this split that the token sees: [lo, end) within the split's span.
    first = jnp.maximum(lo, part * span)
    last = jnp.minimum(end, (part + 1) * span)

    def body(i, carry):
        m, l, acc = carry
        base = pl.multiple_of(i * block, block)
        slot = base + jnp.arange(block)
        seen = ((slot >= first) & (slot < last))[None, :]
        kb1 = k_ref[pl.ds(base, block), pl.ds(0, R)].astype(dtype)
        kb2 = k_ref[pl.ds(base, block), pl.ds(R, R)].astype(dtype)
        s = (_dot_t(q1, kb1) + _dot_t(q2, kb2)) * scale  # [P, block]
        s = jnp.where(seen, s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(seen, jnp.exp(s - m_new[:, None]), 0.0)
        correction = jnp.exp(m - m_new)
        vb = v_ref[pl.ds(base, block), :].astype(dtype)
        acc = acc * correction[:, None] + jnp.dot(p.astype(dtype), vb, preferred_element_type=f32)
        return m_new, l * correction + jnp.sum(p, axis=1), acc

    m, l, acc = jax.lax.fori_loop(first // block, jnp.maximum(first // block, -(-last // block)),
                                  body, (m, l, acc))
    if splits == 1:
        (out_ref,) = out_refs
        plt.store(out_ref.at[pl.ds(0, P), :], (acc / l[:, None]).astype(out_ref.dtype),
                  mask=is_query[:, None])
    else:
        acc_ref, m_ref, l_ref = out_refs
        plt.store(acc_ref.at[pl.ds(0, P), :], acc, mask=is_query[:, None])
        plt.store(m_ref.at[pl.ds(0, P)], m, mask=is_query)
        plt.store(l_ref.at[pl.ds(0, P)], l, mask=is_query)


# Decode projections. A batch-1 decode layer in XLA's hands ran, besides its four matrix-vector
# products, each norm's reduction as a kernel of its own and the SwiGLU multiply, 1-3 us each
# however small the work. `project` folds the norm before, and the bias, SwiGLU or residual
# after, into the product's own kernel: four kernels a layer around the attention kernel.
# Measured on an H200 in chains of layers (norm+qkv, o+residual, norm+gate/up+SwiGLU,
# down+residual): SmolLM2's widths 15.7 us a layer against XLA's 18.4, Llama-3.2-1B's 43.7
# against 44.0, but Llama-3-8B's 123 against 115 (3.55 TB/s against XLA's 3.79) and 8B in int8
# 94 against 89: XLA's reduction streams large matrices faster. So the kernel takes matrices of
# at most KERNEL_MAX_WEIGHTS weights, where launches, not bandwidth, set the time; int8 ones up
# to KERNEL_MAX_INT8_WEIGHTS, since converting them without I2F (below) made it the faster.
# "auto": the kernel on a GPU where `decode_project_mode` allows; "xla" never; "interpret" in
# Pallas' interpreter (tests on the CPU).
DECODE_PROJECT = env_choice("JAXLLM_DECODE_PROJECT", MODES, "auto")
# JAXLLM_PROJECT_MAX_WEIGHTS overrides the limit for benchmarking. 30M (the 8B shape's qkv and
# o, Llama-3.2-1B's down too) lost on both: 4.11 against 4.06 ms a step, 0.892 against 0.889;
# 120M (every 8B layer matrix) in the int8 tiles below lost too: 4.126 against 3.855.
KERNEL_MAX_WEIGHTS = env_number("JAXLLM_PROJECT_MAX_WEIGHTS", 8 * 2**20)
# Tiles: weights a program loads at once (its rows times a chunk of the input channels), the
# largest chunk, warps. Of six sets, 4096,2048,4 was fastest at SmolLM2's and Llama-3.2-1B's
# widths; at Qwen3-0.6B's too (0.700 ms a step against 0.764 for 8192,2048,4, 0.725 for
# 4096,1024,4 and 0.732 for 8192,4096,8). JAXLLM_PROJECT_TILES="elements,chunk,warps" overrides
# them for benchmarking.
PROGRAM_ELEMENTS, MAX_CHUNK, PROJECT_WARPS = env_ints("JAXLLM_PROJECT_TILES", "4096,2048,4")
# A float row of at most ONE_CHUNK_CHANNELS input channels loads in one chunk even past
# MAX_CHUNK, padded to a power of two and masked, rather than in two overlapping ones: of the
# presets only Qwen3-0.6B's down (3072 channels: one of 4096 against two of 2048 at 0 and 1024).
# Qwen3-0.6B took 0.6615, 0.6631 and 0.6587 ms a step against 0.6705, 0.6734 and 0.6625 (H200,
# bench, batch 1, same run; 1508-1518 tok/s against 1485-1509); whole chunks of 1024 (as int8
# rows take below) 0.6806, 0.6824 and 0.6824. int8 rows, not measured so, keep MAX_CHUNK.
# JAXLLM_PROJECT_ONE_CHUNK overrides it (2048: as before).
ONE_CHUNK_CHANNELS = env_number("JAXLLM_PROJECT_ONE_CHUNK", 4096)
# SwiGLU's gate/up loads PROGRAM_ELEMENTS of gate and as many of up a program (twice the weights
# of the other matrices' programs, half the programs) where its weights come from HBM unasked, too
# large for the kernel before to ask L2 for them (`prefetched`): of the presets, Qwen3-0.6B's
# gate/up (12.6 MB; in int8 6.3 MB). Elsewhere the rows halve, gate and up together
# PROGRAM_ELEMENTS. On H200s (bench, batch 1, prompt 128 + 256 new, --repeat 2, alternating in
# each run), as landed (`.device/run185.sh`): Qwen3-0.6B 0.6419 and 0.6495 ms a step against
# 0.6668 and 0.6704 with the rows halved (1558 and 1540 tok/s against 1500 and 1492), int8 0.5885
# and 0.5866 against 0.6117 and 0.6081. Earlier, widened through a probe's per-shape override
# (`run183.sh`, `run184.sh`): 0.6517, 0.6505, 0.6425 and 0.6460 against 0.6775,
# 0.6648, 0.6572 and 0.6624; int8 0.5952, 0.5878, 0.5814 and 0.5870 against 0.6104, 0.6128,
# 0.6129 and 0.6112. Gate/up at 16384 weights a program 0.6620 and 0.6760; qkv at 8192 beside the
# wide gate/up 0.6515 and 0.6537; o alone at 8192 0.6699 and 0.6689. SmolLM2's gate/up, asked of
# L2, widened lost: 0.4109 and 0.4120 against 0.4000 and 0.3942 (int8 0.4406 and 0.4335 against
# 0.4343 and 0.4369). As committed, on another machine (`run186.sh`): 0.6412 and 0.6396 against
# 0.6694 and 0.6593 (1560 and 1563 tok/s against 1494 and 1517); see docs/speed.md.
# The tokens of `generate` are the same either way (`scripts/gpu_check.py generate_loop`).
# JAXLLM_GATE_UP_WIDE=0 halves the rows everywhere.
GATE_UP_WIDE = env_flag("JAXLLM_GATE_UP_WIDE", True)
# int8 weights, converted in registers without I2F (see `_INT8_ASM`), stream faster through the
# kernel than through XLA's reduction up to the 8B shape's gate/up (117M weights), given larger
# tiles. The 8B shape in int8 on an H200, a step: 2.877 ms with every layer matrix in the kernel,
# 3.130 the same with I2F, 3.021 with XLA's reductions (one run). In another: 2.875 against
# 3.027, 2.900 with the lm_head (525M) in the kernel too, 2.989 with gate/up left to XLA. Tiles
# for int8 matrices above KERNEL_MAX_WEIGHTS: rows a program of each operand (SwiGLU's gate and
# up both), the largest chunk, warps. A chunk divides the row where a power of two at least half
# the largest does (the 8B shape's down, 14336 = 7 x 2048), rather than a last chunk overlapping
# the one before. Isolated chains of the 8B shape's matrices (TB/s of int8 bytes): gate/up 3.01
# at 4 rows of each operand against 2.78 at 2 (the earlier 16384 weights a program, SwiGLU
# halving the rows), down 2.49 in 2048-channel chunks against 2.38 in overlapping 4096 ones;
# qkv and o within 3% of their best at 4 rows of 4096. End to end (H200, same run, two rounds):
# 2.775 and 2.785 ms a step against 2.942 and 2.955 with the earlier tiles; 4 rows and 8 warps
# 3.056, 8 rows of 2048 3.348, 2 rows 3.128 against 2.794 (another run). Of the earlier eight
# sets of weights per program, chunk and warps, 16384,4096,4 had been best (8 warps: 3.253 ms;
# 8192,4096,4: 3.054; 32768,8192,8: 2.998). JAXLLM_PROJECT_MAX_INT8_WEIGHTS and
# JAXLLM_PROJECT_INT8_TILES ("rows,chunk,warps") override them for benchmarking.
KERNEL_MAX_INT8_WEIGHTS = env_number("JAXLLM_PROJECT_MAX_INT8_WEIGHTS", 128 * 2**20)
INT8_TILES = env_ints("JAXLLM_PROJECT_INT8_TILES", "4,4096,4")


def decode_project_mode(dtype, rows: int) -> str | None:
    """"gpu", "interpret" or None (XLA): whether a decode step's projections take `project`'s kernel.

    The kernel computes one row (batch 1) and, on a GPU, wants a float16/bfloat16 model; float32
    models keep XLA's exact form.
    """
    return _mode(DECODE_PROJECT, dtype) if rows == 1 else None


def project(x_MC, w_NC, *, norm_C=None, eps: float = 1e-6, bias_N=None, residual_MN=None,
            swiglu: bool = False, out_dtype=None, mode: str | None = None, prefetch=(),
            weights_first: bool = False, down_digits_of=None):
    """[residual +] (rms_norm(x) if norm else x) @ w.T [+ bias], or with `swiglu` (w [2, F, C]: gate
    and up) silu(gate) * up: XLA's `layers` arithmetic, in one kernel when `mode` is "gpu" or
    "interpret", x is one row and w has at most KERNEL_MAX_WEIGHTS weights (KERNEL_MAX_INT8_WEIGHTS
    int8 ones), else in XLA.

    w may be a `QuantizedWeight` (int8 rows, per-output scales), converted in registers.
    The kernel scales each row's products by the norm's inverse RMS after the sum (exact in real
    arithmetic), where XLA rounds the normalized x to its dtype first.
    x may be a `SplitHeads` (the heads of a decode step's attention, C = K*G*H) for a product
    without norm or SwiGLU: the kernel then combines the splits as it loads them, where they are
    few enough (FUSED_HEADS_VALUES); else XLA combines them first.
    `prefetch`: matrices that a later kernel reads; where `prefetched`, the kernel asks L2 for
    them as it finishes (see PREFETCH_MAX_BYTES), a hint that changes no result.
    `weights_first`: the kernel asks for its weights before its input, where they fit one chunk
    (see `weights_first`); the same result, bit for bit. A float matrix's kernel makes the norm's
    sum of squares after the products (SQUARES_LAST), also bit for bit.
    x may be a `DigitRow` (`add_norm`'s, with `digits`): a large int8 SwiGLU gate/up or lm_head
    then takes the tensor-core kernel (`project_digits`, INT8_DIGITS); any other w, the row's x.
    With `down_digits_of` (the step's `down_bounds` and the layer's index in them) the gate/up
    kernel returns its output as a `DigitRow` too, for the down projection (`down_digits`),
    which then takes the same kernel from it.
    """
    if isinstance(x_MC, DigitRow):
        plain = norm_C is None and bias_N is None and residual_MN is None
        kind = "down" if x_MC.count == DOWN_DIGITS else "gate_up" if swiglu else "head"
        if plain and (project_digits(w_NC, mode, swiglu) if kind != "down" else
                      down_digits(w_NC, mode)):
            return _digits_call(x_MC, w_NC, *(down_digits_of or ()), kind=kind,
                                out_dtype=jnp.dtype(out_dtype or x_MC.x.dtype),
                                interpret=mode == "interpret")
        x_MC = x_MC.x
    heads = x_MC if isinstance(x_MC, SplitHeads) else None
    if heads is not None:
        M, C = heads.acc.shape[0], math.prod(heads.acc.shape[2:])
        out_dtype = out_dtype or heads.dtype
    else:
        M, C = x_MC.shape
        out_dtype = out_dtype or x_MC.dtype
    padded = _pow2(C)
    takes = M == 1 and project_takes(w_NC, mode, swiglu, bias_N is not None)
    if heads is not None and not (takes and norm_C is None and not swiglu
                                  and _heads_values(heads) <= FUSED_HEADS_VALUES):
        x_MC, heads = heads.combined().reshape(M, C), None  # XLA combines the splits
    if not takes:
        return _project_xla(x_MC, w_NC, norm_C, eps, bias_N, residual_MN, swiglu, out_dtype)
    width = w_NC.shape[1] if swiglu else w_NC.shape[0]
    float_w = not isinstance(w_NC, QuantizedWeight)  # its own tiles and order below where int8
    if _int8_tiled(w_NC):
        rows, max_chunk, warps = INT8_TILES
        chunk = min(padded, max_chunk)
        if C % chunk and (C & -C) >= chunk // 2:  # whole chunks, not an overlapping last one
            chunk = C & -C
        rows = min(rows, width & -width)
    else:
        chunk = padded if float_w and C <= ONE_CHUNK_CHANNELS else min(padded, MAX_CHUNK)
        # At least 2 rows a program, as measured (a 1-row block never ran on a GPU), where they divide.
        # gate and up sharing the weights, but where gate/up comes from HBM unasked (GATE_UP_WIDE)
        halved = swiglu and (prefetched(w_NC) or not GATE_UP_WIDE)
        rows = min(max(2, PROGRAM_ELEMENTS // chunk // (2 if halved else 1)), width & -width)
        warps = PROJECT_WARPS
    interpret = mode == "interpret"
    ahead = () if interpret else tuple(  # int8 bytes only: the scales are few
        stored(w) for w in prefetch if prefetched(w))
    return _project_kernel_call(x_MC, w_NC, norm_C, bias_N, residual_MN, ahead, eps=eps,
                                swiglu=swiglu, out_dtype=jnp.dtype(out_dtype), rows=rows,
                                chunk=chunk, warps=warps, interpret=interpret,
                                lines=PREFETCH_LINES and not weights_first,
                                weights_first=weights_first and heads is None and C <= chunk,
                                squares_last=SQUARES_LAST and float_w)


def project_takes(w_NC, mode: str | None, swiglu: bool = False, biased: bool = False) -> bool:
    """Whether `project` of one row against w, under `mode`, runs its kernel (which then folds a
    norm in); False where it composes XLA's ops (no mode, large matrices, SwiGLU with a bias)."""
    limit = KERNEL_MAX_INT8_WEIGHTS if isinstance(w_NC, QuantizedWeight) else KERNEL_MAX_WEIGHTS
    return mode is not None and math.prod(w_NC.shape) <= limit and not (swiglu and biased)


# The norm before a large int8 matrix (one in INT8_TILES: the 8B shape's qkv and gate/up) goes
# through `add_norm`'s pass, which writes the normed row once (in x's dtype, as XLA's form
# rounds it), rather than into `project`'s kernel, each of whose 1536 or 3584 programs would load
# the norm's weights and make the sum of squares again. The 8B shape in int8 on an H200 (bench,
# batch 1, same run): 2.6231 and 2.6243 ms a step against 2.6784 and 2.6842 (381 tok/s against
# 373); before gate/up only 2.645 and 2.628, before qkv only 2.653 and 2.650. On another
# machine, as landed: 2.6395 and 2.6553 against 2.7359 and 2.7432. The first layer's qkv,
# fed by the embedding (no residual add to pair the norm with), keeps it. Float matrices and
# small int8 ones keep it too: one kernel fewer, where small models' steps are bound by launches
# (this order not measured for them). JAXLLM_INT8_NORM_APART=0 folds it in everywhere.
INT8_NORM_APART = env_flag("JAXLLM_INT8_NORM_APART", True)


def project_folds_norm(w_NC, mode: str | None, swiglu: bool = False, biased: bool = False) -> bool:
    """Whether a layer should hand the norm before w to `project` (one row, under `mode`) to fold
    into its kernel: where the kernel takes w, unless w is a large int8 matrix (INT8_NORM_APART)."""
    return project_takes(w_NC, mode, swiglu, biased) and not (INT8_NORM_APART and _int8_tiled(w_NC))


def _int8_tiled(w_NC) -> bool:
    """Whether w is a large int8 matrix, past KERNEL_MAX_WEIGHTS: in INT8_TILES, its norm apart."""
    return isinstance(w_NC, QuantizedWeight) and math.prod(w_NC.shape) > KERNEL_MAX_WEIGHTS


def project_digits(w_NC, mode: str | None, swiglu: bool = False, biased: bool = False) -> bool:
    """Whether the norm before w should come as a `DigitRow` (`add_norm(digits=True)`), for the
    tensor-core kernel (INT8_DIGITS): where w is SwiGLU's large int8 gate/up, its norm apart, or
    an int8 matrix past KERNEL_MAX_INT8_WEIGHTS without bias (w [..., C]: the lm_head, which XLA
    would take), and the tiles divide it (C below 2^31 / (128 * 127), so that the int32 sums
    cannot wrap)."""
    if not (INT8_DIGITS and mode is not None and isinstance(w_NC, QuantizedWeight)) or biased:
        return False
    if swiglu:
        N = w_NC.shape[1]
        if not project_takes(w_NC, mode, swiglu) or project_folds_norm(w_NC, mode, swiglu):
            return False
    else:
        N = math.prod(w_NC.shape[:-1])
        if not (INT8_HEAD_DIGITS and N * w_NC.shape[-1] > KERNEL_MAX_INT8_WEIGHTS):
            return False
    return _digit_tiles_divide(w_NC, "gate_up" if swiglu else "head")


def _digit_tiles_divide(w_NC, kind: str) -> bool:
    rows, chunk, _, _ = _digit_tiles(kind)
    N, C = (w_NC.shape[1] if kind == "gate_up" else math.prod(w_NC.shape[:-1])), w_NC.shape[-1]
    return N % rows == 0 and C % chunk == 0 and C * 128 * 127 < 2**31


def down_digits(w_NC, mode: str | None) -> bool:
    """Whether a down projection w [D, F] should take gate/up's output as a `DigitRow` (gate/up's
    kernel writing it, INT8_DOWN_DIGITS) into the tensor-core kernel: a large int8 matrix (past
    KERNEL_MAX_WEIGHTS) that `project`'s kernel would take, the tiles dividing it into programs
    at least 3/4 of the multiprocessors. The layer also needs its gate/up from digits
    (`project_digits`) and no residual in down's product."""
    return (INT8_DIGITS and INT8_DOWN_DIGITS and mode is not None and _int8_tiled(w_NC)
            and w_NC.ndim == 2 and project_takes(w_NC, mode) and _digit_tiles_divide(w_NC, "down")
            and 4 * (w_NC.shape[0] // DOWN_DIGIT_TILES[0]) >= 3 * _multiprocessors())


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


def _digit_tiles(kind: str):
    """(rows, chunk, warps, stages) of `_digits_call`: gate/up's, the lm_head's or down's."""
    return {"gate_up": DIGIT_TILES, "head": HEAD_DIGIT_TILES, "down": DOWN_DIGIT_TILES}[kind]


@functools.partial(jax.jit, static_argnames=("kind", "out_dtype", "interpret"))
def _digits_call(row: DigitRow, w, bounds=None, index=None, *, kind, out_dtype, interpret):
    """`project(row, w)` of a `DigitRow` against a quantized w [N, C], or for `kind` "gate_up"
    against SwiGLU's gate/up [2, F, C]: one program per `rows` output channels (of each of gate
    and up), its weights streamed in chunks. With `bounds` (`down_bounds`) and the layer's
    `index` in them, gate/up's output comes back as a `DigitRow` of DOWN_DIGITS digits too."""
    swiglu = kind == "gate_up"
    q, scale = w.q, w.scale.astype(jnp.float32)
    rows, chunk, warps, stages = _digit_tiles(kind)  # dividing N and C (`project_digits`)
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
                               digits_out=digits_out, trigger=_pdl_trigger(interpret))
    out = pl.pallas_call(
        kernel, grid=(N // rows,),
        in_specs=[pl.BlockSpec((DIGIT_ROWS, C), lambda j: (0, 0)), whole(1)] + w_specs + s_specs,
        out_specs=out_specs, out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret, name=f"decode_{kind}_digits")(row.digits, row.factor, *args)
    return DigitRow(*out, count=DOWN_DIGITS) if digits_out else out


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
    program = _launch_dependents(pl.program_id(0)) if trigger else 0
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
    place = jnp.where(d < count, _power_of_2(8 * jnp.minimum(d, count - 1)), 0.0)[:, None]
    ys = [jnp.sum(acc.astype(f32) * place, axis=0) * factor_ref[0] * s_ref[...]
          for acc, s_ref in zip(sums, s_refs)]
    y = (_swiglu(*ys, o_ref.dtype) if swiglu else ys[0]).astype(o_ref.dtype)
    if trigger:  # the signal's result used, so that the compiler keeps it
        y = jnp.where(program >= 0, y, 0).astype(o_ref.dtype)
    o_ref[0, :] = y
    if digits_out:
        bound = bounds_ref[index_ref[0]] * l1_ref[0] * l1_ref[0]
        _store_down_digits(y.astype(f32), bound, out_digits_ref, out_factor_ref)


def _power_of_2(n):
    """2^n in float32 for integer n in [-126, 127], exactly (the exponent field)."""
    return jax.lax.bitcast_convert_type((n + 127) << 23, jnp.float32)


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
    X = v * _power_of_2(-u)
    T = (X * 2.0**-24).astype(i32)  # |T| < 2^14
    Y = (X - T.astype(jnp.float32) * 2.0**24).astype(i32) + 0x808080
    Z = T + (Y >> 24) + 0x80
    ts = [((Y >> (8 * d)) & 255) - 128 for d in range(3)] + [(Z & 255) - 128, Z >> 8]
    for d, t in enumerate(ts):
        plt.store(digits_ref.at[pl.ds(d, 1), pl.ds(0, v.shape[0])], t.astype(jnp.int8)[None, :])
    factor_ref[...] = jnp.where(biased < 255, _power_of_2(u), jnp.nan).reshape(1)


def _heads_values(heads: SplitHeads) -> int:
    """The values of a `SplitHeads` row as the kernel holds them: splits and K*G to powers of two."""
    _, P, K, G, H = heads.acc.shape
    return _pow2(P) * _pow2(K * G) * H


def _project_xla(x_MC, w_NC, norm_C, eps, bias_N, residual_MN, swiglu, out_dtype):
    """`project` as the layers compose it in XLA."""
    if norm_C is not None:
        x_MC = L.rms_norm(x_MC, norm_C, eps)
    if swiglu:
        y_MN = L.project(x_MC, w_NC)
        y_MN = jax.nn.silu(y_MN[:, 0]) * y_MN[:, 1]
    else:
        y_MN = L.project(x_MC, w_NC, out_dtype)
    if bias_N is not None:
        y_MN = y_MN + bias_N
    return y_MN if residual_MN is None else residual_MN + y_MN


@functools.partial(jax.jit, static_argnames=("eps", "swiglu", "out_dtype", "rows", "chunk",
                                             "warps", "interpret", "weights_first",
                                             "squares_last", "lines"))
def _project_kernel_call(x_MC, w_NC, norm_C, bias_N, residual_MN, ahead=(), *, eps, swiglu,
                         out_dtype, rows, chunk, warps, interpret, weights_first=False,
                         squares_last=False, lines=False):
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
    ahead = [a.reshape(-1) for a in ahead]  # flat, as `_prefetch` addresses them
    specs += [pl.BlockSpec(a.shape, lambda j: (0,)) for a in ahead]
    args += ahead
    kernel = functools.partial(
        _project_kernel, C=C, chunk=chunk, eps=eps, swiglu=swiglu, norm=norm_C is not None,
        scaled=scales is not None, biased=bias_N is not None, residual=residual_MN is not None,
        heads=heads, permute_int8=not interpret and INT8_CONVERT == "permute",
        trigger=_pdl_trigger(interpret), ahead=len(ahead), grid=width // rows, lanes=32 * warps,
        weights_first=weights_first, squares_last=squares_last or weights_first, lines=lines)
    return pl.pallas_call(
        kernel, grid=(width // rows,), in_specs=specs,
        out_specs=pl.BlockSpec((1, rows), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((1, width), out_dtype),
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=1),
        interpret=interpret, name="decode_project")(*args)


def _project_kernel(x_ref, *refs, C, chunk, eps, swiglu, norm, scaled, biased, residual, heads,
                    permute_int8=False, trigger=False, ahead=0, grid=1, lanes=128,
                    weights_first=False, squares_last=False, lines=False):
    """One program: `project` for a few output channels, reading their weight rows in as few
    chunks as fit (one for C <= chunk): each chunk is a single masked load, so the program waits
    on memory once per chunk, not once per loop step of a pipelined tile. With `heads` (splits,
    K*G, H, dtype), x_ref and the next two refs are a `SplitHeads`, combined here. With
    `weights_first` (one chunk, not against heads), the weights are asked for before x (see
    `weights_first`). With `squares_last` the norm's sum of squares is made after the products
    rather than between the loads of x and of the weights (SQUARES_LAST)."""
    refs = list(refs)
    take = lambda n=1: [refs.pop(0) for _ in range(n)]
    if heads is not None:
        m_ref, l_ref = take(2)
    g_ref = take()[0] if norm else None
    w_refs = take(2 if swiglu else 1)
    s_refs = take(len(w_refs)) if scaled else [None] * len(w_refs)
    b_ref = take()[0] if biased else None
    r_ref = take()[0] if residual else None
    ahead_refs = take(ahead)
    (o_ref,) = refs
    f32, dtype = jnp.float32, x_ref.dtype
    rows = w_refs[0].shape[0]
    program = _launch_dependents(pl.program_id(0)) if trigger else 0
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
    for ref in ahead_refs:  # once this program's weights are in: they go first
        _prefetch(ref, grid, lanes, after=jnp.sum(ys[-1]), lines=lines)
    if norm:  # as layers.rms_norm: statistics in float32, eps inside the rsqrt
        ys = [y * jax.lax.rsqrt(squares / C + eps) for y in ys]
    ys = [y if s_ref is None else y * s_ref[...] for y, s_ref in zip(ys, s_refs)]
    if swiglu:
        y = _swiglu(*ys, dtype)
    else:
        y = ys[0]
    y = y.astype(o_ref.dtype)
    if biased:
        y = y + b_ref[...].astype(o_ref.dtype)
    if residual:
        y = r_ref[0, :].astype(o_ref.dtype) + y
    if trigger:  # the signal's result used, so that the compiler keeps it
        y = jnp.where(program >= 0, y, 0).astype(o_ref.dtype)
    o_ref[0, :] = y


# Decode steps of several rows (ROWS_MIN to ROWS_MAX). XLA ran each of the 8B shape's layers at
# batch 32 as its four GEMMs, the attention kernel and its splits' combine, and five small
# fusions (two residual adds, two norms, SwiGLU's multiply), 1.8-2.5 us each (H200 trace).
# `rows_project` runs each matrix as a tensor-core kernel that adds the bias and the residual to
# its output tile and takes SwiGLU's gate and up as two operands of one program; the norms stay
# XLA's, one fusion each. In chains of 8B-shaped matrices at 32 rows (H200, us a matrix, the
# kernel against XLA's GEMM with its fusions): qkv 17.2 against 17.8-18.5, o with the residual
# 12.5 against 11.7-11.9, gate/up with SwiGLU 60.4 against 60.5-65.7, down with the residual 32.2
# against 32.7-34.0. The 8B shape at batch 32 (bench, --repeat 2, same run): 4.7686 and 4.7766
# ms a step against 4.9029 and 4.9006 (6710 and 6699 tok/s against 6527 and 6530); in another
# run 4.7602 and 4.7669 against 4.9067 and 4.9063; SmolLM2 0.7862 against 0.8224, Llama-3.2-1B
# 1.1149 against 1.1393, Qwen3-0.6B 1.3315 against 1.3344; as landed, 4.7297 against 4.8403.
# Fewer rows (8-31; under 16 padded to 16) take it too, but only in models whose every matrix
# has at least ROWS_LARGE_WEIGHTS weights (the 8B shape's): there, same run, 8 rows 4.2395 ms a
# step against 4.2724 with XLA's GEMMs, 16 rows 4.3346 against 4.4705, 24 rows 4.5332 against
# 4.6609 (32 rows, their code unchanged, 4.643 against 4.8089 there); Qwen3-0.6B and
# Llama-3.2-1B lost at 16 and 24 rows (1.1305 against 1.0976, 1.0847 against 1.0244 at 16).
# Programs of 16 padded rows give no PDL signal (ROWS_SIGNAL_ROWS): with it the 8B shape lost
# at 16 rows (4.6888 ms against 4.3909 without it) and 8 rows (4.5612 against 4.2806); at 32
# the signal gains a little (4.7621, 4.7839, 4.7879 against 4.7976 and 4.7992), at 28 rows
# 4.6901 against 4.7447, at 24 4.659 against 4.6652. Our reading (not measured): a 16-row
# program takes less shared memory (the 8B qkv's about 100 KB against 120), so the next
# kernel's programs, let in early by the signal, share its multiprocessor and wait there.
# 64 rows stay on XLA: with 4 stages where 5 do not fit, 6.0684 ms against 5.5318.
# Measured and dropped: the signal after the loop (32 rows 4.8864 ms, 16 rows 4.3994); the dot
# as w @ x.T (the weights as the tensor core's M side; in chains at 32 rows qkv 18.7 us against
# 17.4, gate/up 66.1 against 60.0, o and down within 2%); each program asking L2 for its first
# 32-256 KB of weights and then waiting for the kernel ahead (griddepcontrol.wait) before its
# loop, 4.968-5.5895 ms against 4.7501-4.7559 (a Pallas kernel's first instruction ran 0.86-0.93
# us after the kernel ahead had ended, so nothing runs before that wait on this stack).
# Measured and dropped: the norm folded into the kernel. Any use of the loaded x but the dot (its
# squares alone) left Triton's loop waiting on each load (the 8B qkv at 32 rows 51-63 us against
# 17.2); the norm's input made instead by the kernel that writes the residual (x * g and each
# program's sums of squares, which the next kernel adds up before its loop) cost more than XLA's
# norm: qkv 20.8 us against 17.3, down 36.5 against 32.2, and the step 5.108 ms against 4.7602.
# JAXLLM_ROWS_PROJECT: "auto", "xla" or "interpret", as DECODE_PROJECT;
# JAXLLM_ROWS_TILES="outputs,chunk,warps,stages" overrides the tiles for benchmarking.
ROWS_PROJECT = env_choice("JAXLLM_ROWS_PROJECT", MODES, "auto")
ROWS_MIN, ROWS_MAX = 8, 32
ROWS_SIGNAL_ROWS = 32  # padded rows from which the kernel gives the PDL signal
ROWS_ANY_SIZE = 32  # rows from which any model's matrices take the kernel
ROWS_LARGE_WEIGHTS = 16 * 2**20  # below ROWS_ANY_SIZE rows, each matrix's fewest weights
ROWS_TILES = env_ints("JAXLLM_ROWS_TILES", "0,0,4,5")


def rows_project_mode(dtype, rows: int) -> str | None:
    """"gpu", "interpret" or None (XLA): whether a decode step of `rows` rows (ROWS_MIN to
    ROWS_MAX) takes `rows_project`'s kernel (float16/bfloat16 models on a GPU, as `_mode`);
    below ROWS_ANY_SIZE rows a model's step takes it only for large matrices (`rows_sized`)."""
    return _mode(ROWS_PROJECT, dtype) if ROWS_MIN <= rows <= ROWS_MAX else None


def rows_tiles(width: int, C: int):
    """(outputs, chunk, warps, stages) of `_rows_call` for `width` outputs and C channels, or None
    where none divide them. 64 outputs a program where that gives at least 2/3 of the
    multiprocessors' programs (the 8B shape's qkv, 96; gate/up, 224), else 32 (its o and down,
    128); chunks of 8192 / outputs channels (16 KB of weights a stage in bf16), halved until they
    divide C. Measured at 32 rows (us a matrix): qkv 17.2 at 64,128 against 20.3 at 32,256; o
    12.6 at 32,256 against 17.6 at 64,128; down 32.1 at 32,256 against 53.4 at 64,128 and 44.9 at
    16,256; gate/up 60.4 at 64,128 against 85.9 at 32,256; 5 stages against 3-8, 8 warps no gain."""
    outputs, chunk, warps, stages = ROWS_TILES
    if not outputs:
        outputs = next((n for n in (64, 32, 16) if width % n == 0 and 3 * (width // n)
                        >= 2 * _multiprocessors()), 16 if width % 16 == 0 else 0)
        chunk = 8192 // max(outputs, 1)
        while chunk > 16 and C % chunk:
            chunk //= 2
    if not outputs or width % outputs or C % chunk:
        return None
    return outputs, chunk, warps, stages


def rows_sized(rows: int, shapes) -> bool:
    """Whether matrices of these (outputs, channels) `shapes` take the kernel at `rows` rows:
    from ROWS_ANY_SIZE rows all do, below it those of at least ROWS_LARGE_WEIGHTS weights each."""
    return rows >= ROWS_ANY_SIZE or all(math.prod(s) >= ROWS_LARGE_WEIGHTS for s in shapes)


def rows_takes(w_NC, mode: str | None, swiglu: bool = False) -> bool:
    """Whether `rows_project` runs its kernel for a float w [N, C] (gate/up [2, F, C])."""
    return _rows_tiles_of(w_NC, mode, swiglu) is not None


def _rows_tiles_of(w_NC, mode: str | None, swiglu: bool):
    """`rows_tiles` of w under `mode`, None where the kernel does not take it."""
    if mode is None or isinstance(w_NC, QuantizedWeight):
        return None
    return rows_tiles(w_NC.shape[1] if swiglu else w_NC.shape[0], w_NC.shape[-1])


def rows_project(x_MC, w_NC, *, norm_C=None, eps: float = 1e-6, bias_N=None, residual_MN=None,
                 swiglu: bool = False, mode: str | None = None):
    """`project` for a decode step's rows: [residual +] (rms_norm(x) if norm else x) @ w.T
    [+ bias], or with `swiglu` silu(gate) * up; the product and its epilogue in one kernel where
    `rows_takes` and x has at most ROWS_MAX rows, else XLA's form. The norm is always XLA's,
    before the kernel."""
    tiles = _rows_tiles_of(w_NC, mode, swiglu)
    if tiles is None or x_MC.shape[0] > ROWS_MAX:
        return _project_xla(x_MC, w_NC, norm_C, eps, bias_N, residual_MN, swiglu, x_MC.dtype)
    if norm_C is not None:
        x_MC = L.rms_norm(x_MC, norm_C, eps)
    return _rows_call(x_MC, w_NC, bias_N, residual_MN, swiglu=swiglu, tiles=tiles,
                      interpret=mode == "interpret")


def _rows_padded(M: int) -> int:
    """x's M rows as `_rows_kernel` pads them: a power of two, at least 16 (the tensor core's
    fewest), the padding masked."""
    return max(16, _pow2(M))


@functools.partial(jax.jit, static_argnames=("swiglu", "tiles", "interpret"))
def _rows_call(x_MC, w_NC, bias_N=None, residual_MN=None, *, swiglu, tiles, interpret):
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
        _rows_kernel, M=M, chunk=chunk, swiglu=swiglu, biased=bias_N is not None,
        residual=residual_MN is not None,
        trigger=_pdl_trigger(interpret) and P >= ROWS_SIGNAL_ROWS)
    return pl.pallas_call(
        kernel, grid=(width // outputs,), in_specs=specs, out_specs=columns,
        out_shape=jax.ShapeDtypeStruct((M, width), x_MC.dtype),
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret, name="decode_rows_project")(*args)


def _rows_kernel(x_ref, *refs, M, chunk, swiglu, biased, residual, trigger):
    """One program of `_rows_call`: its outputs' sums over the chunks of C, each a tensor-core
    dot of x's rows (padded to P >= 16, the padding masked) with the chunk of weights."""
    refs = list(refs)
    take = lambda: refs.pop(0)
    w_refs = [take() for _ in range(2 if swiglu else 1)]
    b_ref = take() if biased else None
    r_ref = take() if residual else None
    (o_ref,) = refs
    P, C = _rows_padded(M), x_ref.shape[1]
    program = _launch_dependents(pl.program_id(0)) if trigger else 0
    real = (jnp.arange(P) < M)[:, None]
    rows_of = jnp.broadcast_to(real, (P, chunk))

    def step(k, sums):
        at = pl.multiple_of(k * chunk, chunk)
        x = plt.load(x_ref.at[pl.ds(0, P), pl.ds(at, chunk)], mask=rows_of, other=0)
        return tuple(acc + _dot_t(x, w_ref[:, pl.ds(at, chunk)]) for acc, w_ref in zip(sums, w_refs))

    zeros = jnp.zeros((P, w_refs[0].shape[0]), jnp.float32)
    sums = jax.lax.fori_loop(0, C // chunk, step, (zeros,) * len(w_refs))
    y = (_swiglu(*sums, x_ref.dtype) if swiglu else sums[0]).astype(o_ref.dtype)
    if biased:
        y = y + b_ref[...].astype(o_ref.dtype)[None, :]
    if residual:
        y = plt.load(r_ref.at[pl.ds(0, P), :], mask=real, other=0).astype(o_ref.dtype) + y
    if trigger:  # the signal's result used, so that the compiler keeps it
        y = jnp.where(program >= 0, y, 0).astype(o_ref.dtype)
    plt.store(o_ref.at[pl.ds(0, P), :], y, mask=real)


def _swiglu(gate, up, dtype):
    """silu(gate) * up in float32, from float32 sums, rounded as `layers.mlp` rounds it: the
    products in the model's dtype, then silu(gate) in it."""
    gate, up = (y.astype(dtype).astype(jnp.float32) for y in (gate, up))
    return (gate * jax.nn.sigmoid(gate)).astype(dtype).astype(jnp.float32) * up


# How the kernel converts int8 weights to float32 on a GPU: "permute" (`_INT8_ASM`) or "i2f"
# (the compiler's convert). I2F issues at a quarter of the float rate: streaming int8 near the
# memory's speed takes about 16 conversions a clock per multiprocessor, all that I2F gives.
INT8_CONVERT = env_choice("JAXLLM_INT8_CONVERT", ("permute", "i2f"), "permute")

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


def _to_f32(w, permute: bool):
    """A loaded weight tile as float32; int8 through `_INT8_ASM` when `permute` (GPU only)."""
    if not (permute and w.dtype == jnp.int8):
        return w.astype(jnp.float32)
    (bits,) = plt.elementwise_inline_asm(
        _INT8_ASM, args=[w], constraints="=r,=r,=r,=r,r", pack=4,
        result_shape_dtypes=[jax.ShapeDtypeStruct(w.shape, jnp.int32)])
    return jax.lax.bitcast_convert_type(bits, jnp.float32) - (2.0**23 + 128)


def _combined_heads(acc_ref, m_ref, l_ref, splits, KG, H, dtype):
    """`SplitHeads.combined` of one row as [KG', H] float32 (KG' = KG to a power of two, the
    padding zero), rounded to the heads' dtype as XLA's combine; and the mask of real rows."""
    SP, KGp = _pow2(splits), _pow2(KG)
    real = jnp.arange(KGp) < KG
    seen = (jnp.arange(SP) < splits)[:, None] & real[None, :]
    m = plt.load(m_ref.at[pl.ds(0, SP), pl.ds(0, KGp)], mask=seen, other=_NEG)
    l = plt.load(l_ref.at[pl.ds(0, SP), pl.ds(0, KGp)], mask=seen, other=0)
    acc = plt.load(acc_ref.at[pl.ds(0, SP), pl.ds(0, KGp), pl.ds(0, H)], mask=seen[:, :, None],
                   other=0)
    w = jnp.exp(m - jnp.max(m, axis=0, keepdims=True))  # padded splits: exp(-1e30 - m) = 0
    total = jnp.where(real, jnp.sum(l * w, axis=0), 1.0)  # padded rows: 0 / 1, not 0 / 0
    combined = jnp.sum(acc * w[:, :, None], axis=0) / total[:, None]
    return combined.astype(dtype).astype(jnp.float32), real


# L2 prefetch. A batch-1 decode step of a small model is a chain of short kernels, each of which
# starts reading its weights only once the kernel ahead has ended, so the memory idles through
# every launch, ramp and tail. `project`'s kernel therefore asks L2 for the next projection's
# matrix, each program once its own sums are made, with Hopper's bulk prefetch
# (cp.async.bulk.prefetch.L2, sm_90): one instruction a lane, no registers held. Pallas has no
# prefetch and its refs' addresses are not values, so a small primitive does it, lowered through
# Pallas' Triton lowering rules (JAX internals: where they are missing, nothing is prefetched).
# On an H200 (bench, batch 1, same run) SmolLM2 took 0.4448 and 0.4436 ms a step against 0.4861
# and 0.4878 without (2254 tok/s against 2050). Larger matrices lost, however early they were
# asked for: every matrix asked for one kernel ahead, Qwen3-0.6B 0.774-0.794 against 0.694-0.703,
# Llama-3.2-1B 0.920 against 0.820, the 8B shape in int8 3.286 against 2.673; two kernels ahead
# 0.697 (unchanged), 0.860 and 2.859; asked at the programs' start rather than after their own
# sums, 0.745-0.752 (Qwen3-0.6B) and 3.063 (int8). In a trace, a kernel that asks lasts longer
# by about the time the memory takes to bring what it asked for (Qwen3-0.6B's gate/up, asking
# for down's 6.3 MB: 11.2 us against 9.4, 6.3 MB at 3.4 TB/s), and a kernel reading 8-12 MB
# from L2 is hardly faster (its qkv: 8.2 us against 8.5);
# SmolLM2's, a load or two a program, all gained (3.8-5.4 us against 4.7-5.7). So only matrices
# of at most PREFETCH_MAX_BYTES are asked for: SmolLM2's all; Qwen3-0.6B's o projection only
# (0.6965 against 0.7004), but in int8 its qkv, o and down too, 0.6313 and 0.6338 ms against
# 0.6907 and 0.6953 (1584 tok/s against 1448; SmolLM2 in int8 unchanged, 0.4524 against
# 0.4508). At 8 MB Qwen3-0.6B lost (0.7355 and 0.7326 against 0.7004 and 0.7041, 4 MB 0.6973
# and 0.6970, same run), Llama-3.2-1B too (0.883 against 0.820-0.824).
# JAXLLM_PREFETCH_MAX_MB sets it; 0 turns prefetching off.
PREFETCH_MAX_BYTES = int(env_number("JAXLLM_PREFETCH_MAX_MB", "4", float) * 2**20)
PREFETCH_PIECE = 4096  # the least bytes one lane asks for
# Pieces go to lanes as measured above: lane t of program p (of P) asks for piece
# t*A + p - (P - A), where that piece exists, A being this many times the multiprocessor count
# (or P, if fewer). So each piece is asked for by one lane in every A-th program, the first ask
# early in the kernel, the last among its last A programs; a repeated ask finds the piece on its
# way or in L2. (Asks from the last A programs only, what this was written to do, were not
# measured.)
PREFETCH_STRIDE_PER_MULTIPROCESSOR = 2

_PREFETCH_ASM = """{
.reg .pred p;
setp.ne.s32 p, $2, 0;
@p cp.async.bulk.prefetch.L2.global [$1], $2;
mov.b32 $0, 0;
}"""
# Where a layer's weights come from HBM (not `weights_first`), the kernel asks a line at a time
# instead (`prefetch.global.L2::evict_last`, up to PREFETCH_LINE_COUNT lines of 128 bytes a lane,
# the pieces dealt over every program's lanes): the bulk copy holds the asking kernel open until
# what it asked for has come (our reading of the traces above), a line asked for does not. Of
# the presets only Qwen3-0.6B's layers ask so: its o projection (4 MB), and in int8 its qkv, o
# and down. On H200s (bench, batch 1, prompt 128 + 256 new, --repeat 2, alternating in each run):
# Qwen3-0.6B 0.6610 and 0.6609 ms a step against 0.6700, 0.6644 and 0.6621 (2026-12-01,
# `.device/run179.sh`); 0.6695, 0.6654 and 0.6631 against 0.6779, 0.6699 and 0.6711 on another
# machine (`run180.sh`); earlier, on a third, 0.6585-0.6692 against 0.6665-0.6759; as
# landed, on a fourth, 0.6740, 0.6637 and 0.6662 against 0.6684, 0.6736 and 0.6719 (`run182.sh`;
# its first round is the one of those eight where lines lost): about 0.5-1%. In int8
# 0.6098 and 0.6086 against 0.6114 and 0.6156, as landed 0.6085 against 0.6103. In SmolLM2's
# weights-first layers, whose every matrix is asked for, lines lost (0.4089 and 0.3983 against
# 0.3898 and 0.3936), so they keep the bulk copy. The tokens of `generate` are the same either
# way (`scripts/gpu_check.py`). JAXLLM_PREFETCH_LINES=0 turns lines off (the bulk copy everywhere).
PREFETCH_LINES = env_flag("JAXLLM_PREFETCH_LINES", True)
PREFETCH_LINE_COUNT = 16  # lines one lane asks for, at most: a matrix needing more is not asked for
_PREFETCH_LINES_ASM = "{\n.reg .pred p;\n" + "".join(
    f"setp.gt.s32 p, $2, {128 * i};\n@p prefetch.global.L2::evict_last [$1+{128 * i}];\n"
    for i in range(PREFETCH_LINE_COUNT)) + "mov.b32 $0, 0;\n}"


def _prefetch_primitive(asm: str, name: str):
    """The primitive (ref, element offsets [n], byte counts [n]) -> int32 [n] zeros that asks L2
    for those ranges of ref by `asm` (a count of 0 asks nothing), or None where JAX's internals
    differ."""
    try:
        from jax._src import core as jax_core
        from jax._src.interpreters import partial_eval as pe
        from jax._src.lib.mlir import ir
        from jax._src.lib.triton import dialect as tt_dialect
        from jax._src.pallas.triton import lowering as triton_lowering
        add, broadcast = triton_lowering._add, triton_lowering._bcast_to
    except (ImportError, AttributeError):
        return None
    prim = jax_core.Primitive(name)
    prim.def_abstract_eval(lambda ref, offsets, counts: jax_core.ShapedArray(offsets.shape, jnp.int32))
    pe.dce_rules[prim] = lambda used, eqn: ([True] * len(eqn.invars), eqn)  # its effect is the point

    @triton_lowering.register_lowering(prim)
    def _lower(ctx, ptr, offsets, counts):
        shape = ctx.avals_in[1].shape
        out = ir.RankedTensorType.get(shape, ir.IntegerType.get_signless(32))
        return tt_dialect.elementwise_inline_asm(
            [out], asm, constraints="=r,l,r", pure=False, packed_element=1,
            args=[add(broadcast(ptr, shape), offsets), counts])

    return prim


_PREFETCH_P = _prefetch_primitive(_PREFETCH_ASM, "jaxllm_l2_prefetch")
_PREFETCH_LINES_P = _prefetch_primitive(_PREFETCH_LINES_ASM, "jaxllm_l2_prefetch_lines")


def prefetched(w) -> bool:
    """Whether a kernel asks L2 for matrix w (a `QuantizedWeight`'s int8 bytes) ahead of its
    use: on a GPU from Hopper on, for at most PREFETCH_MAX_BYTES."""
    if w is None or _PREFETCH_P is None or L.gpu_generation() < 9:
        return False
    w = stored(w)
    return w.size * jnp.dtype(w.dtype).itemsize <= PREFETCH_MAX_BYTES


# A layer whose projections all come from L2 (each matrix small enough that the kernel before
# asks for it, above) loads each kernel's weights before its input x, and makes the norm's sum of
# squares after the products rather than before them. In the other order the weights are asked
# for only after that sum, a reduction across the program's warps, so an L2-resident matrix waited
# for two round trips (x, then the weights) where one will do (our reading). The sums are the
# same, bit for bit. On an H200 (bench, batch 1, same run) SmolLM2, every matrix of which
# qualifies, took 0.3854 and 0.3892 ms a step against 0.4277 and 0.4341 (2595 and 2569 tok/s
# against 2338 and 2304); on another machine 0.3887 against 0.4390. Where the weights come
# from HBM the same order lost: Qwen3-0.6B with it in its one-chunk projections (qkv, o and
# gate/up, of which only o's 4 MB is asked of L2) 0.7377 ms against 0.6766; with it in every
# projection, the products of several chunks summed once at the end, 0.7365 and 0.7428 against
# 0.6758 and 0.6752, and the 8B shape in int8 5.446 against 2.666. So only layers whose every
# projection `prefetched` asks L2 for, in a float dtype (int8 was not measured so), take it; of
# the presets, SmolLM2's. JAXLLM_WEIGHTS_FIRST=0 turns it off. Most of the gain is the weights'
# order: with the squares last either way (SQUARES_LAST, below), SmolLM2 without it took 0.4140,
# 0.4124 and 0.4138 ms a step against 0.3803, 0.3856 and 0.3856 (same run; the faster side also
# loaded o's weights before combining the heads, about 0.006 ms of it, see docs/speed.md).
WEIGHTS_FIRST = env_flag("JAXLLM_WEIGHTS_FIRST", True)

# Every float matrix's kernel, its weights from HBM or L2, makes the norm's sum of squares after
# the products too (x loaded first, as before): the weights are then asked for right after x
# rather than after that reduction across the warps. The same sums, bit for bit (the H200 gave
# the same bits in every order for SmolLM2's, Qwen3-0.6B's and Llama-3.2-1B's matrices, with and
# without the norm). Qwen3-0.6B, bench, batch 1, same runs: 0.6672, 0.6672 and 0.6711 ms a step
# against 0.6736, 0.6802 and 0.6781; on another machine 0.6733 and 0.6638 against 0.6795 and
# 0.6745; on a third 0.6660 and 0.6695 against 0.6753 and 0.6818 (1485-1506 tok/s against
# 1466-1483). Llama-3.2-1B unchanged: 0.8109, 0.8101 and 0.8190 against 0.8134, 0.8135 and
# 0.8198; 0.8161 against 0.8121. int8 matrices keep the squares before: the 8B shape in int8 took
# 2.7608 and 2.7746 ms with them last against 2.7281 and 2.7415. JAXLLM_SQUARES_LAST=0 turns it
# off (the squares before the weights' load wherever the weights are not loaded first).
SQUARES_LAST = env_flag("JAXLLM_SQUARES_LAST", True)


def weights_first(matrices) -> bool:
    """Whether a layer's projection kernels load their weights before their input (see
    WEIGHTS_FIRST): where every one of its `matrices` is a float matrix that `prefetched`."""
    return WEIGHTS_FIRST and all(w is not None and not isinstance(w, QuantizedWeight)
                                 and prefetched(w) for w in matrices)


def _prefetch(ref, programs: int, lanes: int, after, lines: bool = False):
    """Ask L2 for all of the flat ref, in pieces dealt to the lanes of the kernel's `programs`
    (see PREFETCH_STRIDE_PER_MULTIPROCESSOR); `after`, a float the program computed, holds the
    asks back until it is made. With `lines`, a line at a time (PREFETCH_LINES), each piece
    asked for once, by one lane of one program."""
    nbytes = ref.shape[0] * jnp.dtype(ref.dtype).itemsize // 16 * 16  # bulk sizes are of 16s
    if lines:  # pieces of whole lines, every program's lanes sharing the matrix
        stride = programs
        piece = -(-nbytes // (stride * lanes * 128)) * 128
        if piece > 128 * PREFETCH_LINE_COUNT:
            return
    else:
        stride = min(programs, PREFETCH_STRIDE_PER_MULTIPROCESSOR * _multiprocessors())
        piece = max(PREFETCH_PIECE, -(-nbytes // (stride * lanes)) // 16 * 16 + 16)
    q = jnp.arange(lanes, dtype=jnp.int32) * stride + pl.program_id(0) - (programs - stride)
    counts = jnp.where(q >= 0, jnp.clip(nbytes - q * piece, 0, piece), 0)  # q < 0: no piece
    counts = jnp.where(jnp.isnan(after), 0, counts)  # never true for a sum made; but it waits
    offsets = jnp.where(counts > 0, q * (piece // jnp.dtype(ref.dtype).itemsize), 0)
    (_PREFETCH_LINES_P if lines else _PREFETCH_P).bind(ref, offsets, counts)


# Residual add and RMSNorm. Between a prefill layer's matrix products XLA ran the residual add,
# the norm's reduction and the normalizing multiply as three kernels, each a pass over the
# activations: 38.6 us after the down projection and 27.6 after o (add and reduction fused) of
# the 8B shape's 1.45 ms layer at 2048 tokens on an H200, where one pass (read x and the delta,
# write the sum and the normed sum) moves 67 MB, about 17 us. `add_norm` is that pass; the
# 8B shape's 2048-token prefill took 48.84 ms with it against 49.42 without (bench, same run).
# At batch 32, when XLA's GEMMs ran those steps, the kernel lost (4.87 against 4.82 ms a step);
# with `rows_project`'s kernels it now takes o's output and the residual before gate/up (see
# model._rows_block: 4.68-4.69 ms against 4.70-4.71). At batch 1 it serves the norms before
# matrices too large for `project`'s kernel (which folds a norm in itself): Llama-3.2-1B 0.847
# against 0.868 ms a step, the 8B shape 3.958 against 4.003.
# "auto": the kernel on a GPU where `add_norm_mode` allows; "xla" never; "interpret" in Pallas'
# interpreter (tests on the CPU).
ADD_NORM = env_choice("JAXLLM_ADD_NORM", MODES, "auto")
# The PDL signal (see PDL_TRIGGER) in this kernel too, where its programs fit on the GPU at once
# (decode steps): the 8B shape at batch 1 took 3.885 and 3.884 ms a step against 3.899 and 3.897
# (H200, same run), on a slower H200 3.996 and 4.002 against 4.013 and 4.011; a 2048-token
# prefill, many waves of programs, 48.45 ms against 47.59, so it never signals there.
# `scripts/gpu_check.py` passed with it (decode through this kernel against XLA, and generate's
# tokens identical with the signals off). JAXLLM_PDL_ADD_NORM=0 turns it off.
ADD_NORM_TRIGGER = env_flag("JAXLLM_PDL_ADD_NORM", True)
# Tiles: rows a program (at most; a power of two that divides the row count), warps a program.
# JAXLLM_ADD_NORM_TILES="rows,warps" overrides them for benchmarking.
ADD_NORM_ROWS, ADD_NORM_WARPS = env_ints("JAXLLM_ADD_NORM_TILES", "1,4")
# Warps of the one program that also writes a `DigitRow` (see INT8_DIGITS): the 8B shape in
# int8 with digits before qkv and gate/up took 2.627 ms a step in 16 warps against 2.675 in 4
# and 2.648 in 8 (H200, same run); without digits 16 warps gave 2.632 against 2.638 (not taken).
# With digits before gate/up and the lm_head, as landed, 8 warps took 2.5537 ms and 4 2.5595
# against 2.5315 and 2.5504 in 16 (another machine, same run).
ADD_NORM_DIGIT_WARPS = env_number("JAXLLM_ADD_NORM_DIGIT_WARPS", "16")


def add_norm_mode(dtype) -> str | None:
    """"gpu", "interpret" or None (XLA): whether `add_norm` takes its kernel (float16/bfloat16
    models on a GPU; float32 ones keep XLA's exact form)."""
    return _mode(ADD_NORM, dtype)


def add_norm(x_MC, delta_MC, norm_C, eps: float, *, mode: str | None = None,
             digits: bool = False):
    """(x + delta, rms_norm(x + delta) with weight norm): the residual stream and the next
    block's normed input, in one kernel per row when `mode` is "gpu" or "interpret", else XLA.
    With `digits` (one row, a kernel's mode) the normed row comes as a `DigitRow`, for
    `project`'s tensor-core kernel (INT8_DIGITS)."""
    if mode is None:
        sum_MC = x_MC + delta_MC
        return sum_MC, L.rms_norm(sum_MC, norm_C, eps)
    digits = digits and x_MC.shape[0] == 1
    out = _add_norm_call(x_MC, delta_MC.astype(x_MC.dtype), norm_C, eps=eps,
                         interpret=mode == "interpret", digits=digits)
    return (out[0], DigitRow(*out[1:])) if digits else out


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "digits"))
def _add_norm_call(x_MC, delta_MC, norm_C, *, eps, interpret, digits=False):
    M, C = x_MC.shape
    P = _pow2(C)  # the row's tile, masked past C
    rows = min(ADD_NORM_ROWS, M & -M)
    trigger = ADD_NORM_TRIGGER and _pdl_trigger(interpret) and M // rows <= _multiprocessors()
    block = pl.BlockSpec((rows, C), lambda i: (i, 0))
    normed_dtype = jnp.result_type(norm_C.dtype, x_MC.dtype)
    out_specs = [block, block]
    out_shape = [jax.ShapeDtypeStruct((M, C), x_MC.dtype), jax.ShapeDtypeStruct((M, C), normed_dtype)]
    if digits:  # one row (M = 1): its digits, their factor, its sum of magnitudes
        out_specs += [pl.BlockSpec((DIGIT_ROWS, C), lambda i: (0, 0))] + \
            [pl.BlockSpec((1,), lambda i: (0,))] * 2
        out_shape += [jax.ShapeDtypeStruct((DIGIT_ROWS, C), jnp.int8)] + \
            [jax.ShapeDtypeStruct((1,), jnp.float32)] * 2
    return pl.pallas_call(
        functools.partial(_add_norm_kernel, C=C, P=P, eps=eps, trigger=trigger), grid=(M // rows,),
        in_specs=[block, block, pl.BlockSpec((C,), lambda i: (0,))], out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(
            num_warps=ADD_NORM_DIGIT_WARPS if digits else ADD_NORM_WARPS, num_stages=1),
        interpret=interpret, name="add_norm")(x_MC, delta_MC, norm_C)


def _add_norm_kernel(x_ref, d_ref, g_ref, sum_ref, normed_ref, *digit_refs, C, P, eps,
                     trigger=False):
    """A few rows: the sum rounded to x's dtype (as XLA's add), then `layers.rms_norm` of it;
    with `digit_refs` (digits, factor, l1) also the one row's `DigitRow` digits and its sum of
    magnitudes."""
    f32 = jnp.float32
    cols = (jnp.arange(P) < C)[None, :]
    if trigger:  # the signal's result used, so that the compiler keeps it
        cols = cols & (_launch_dependents(pl.program_id(0)) >= 0)
    at = (pl.ds(0, x_ref.shape[0]), pl.ds(0, P))
    x = plt.load(x_ref.at[at], mask=cols, other=0).astype(f32)
    d = plt.load(d_ref.at[at], mask=cols, other=0).astype(f32)
    g = plt.load(g_ref.at[pl.ds(0, P)], mask=cols[0], other=0).astype(f32)
    total = (x + d).astype(sum_ref.dtype)
    plt.store(sum_ref.at[at], total, mask=cols)
    s = total.astype(f32)
    normed = (s * jax.lax.rsqrt(jnp.sum(s * s, axis=1, keepdims=True) / C + eps)).astype(x_ref.dtype)
    normed = (g[None, :] * normed.astype(f32)).astype(normed_ref.dtype)
    plt.store(normed_ref.at[at], normed, mask=cols)
    if digit_refs:
        *digit_refs, l1_ref = digit_refs
        _store_digits(normed[0].astype(f32), cols[0], *digit_refs)
        l1_ref[...] = jnp.sum(jnp.abs(normed.astype(f32))).reshape(1)


def _store_digits(v, cols, digits_ref, factor_ref):
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
    X = (v * _power_of_2(30 - e)).astype(i32)
    Y = X + 0x808080
    for d in range(DIGITS):
        t = (Y >> 24) if d == DIGITS - 1 else ((Y >> (8 * d)) & 255) - 128
        plt.store(digits_ref.at[pl.ds(d, 1), pl.ds(0, v.shape[0])], t.astype(jnp.int8)[None, :],
                  mask=cols[None, :])
    finite = jnp.sum(v * 0.0) == 0  # no inf or NaN in the row
    factor_ref[...] = jnp.where(finite, _power_of_2(e - 30), jnp.nan).reshape(1)


# A MoE layer's routing: the softmax over the router's logits, the top A experts and their
# weights (renormalized with norm_topk_prob), as `layers.route` computes them. XLA ran that as a
# softmax kernel and a sort for the top-k, each 1-3 us however few the values: of a Qwen3-30B-A3B
# decode layer's 51.6 us at batch 1 (H200 trace), 1.3 us the softmax and 3.2 the sort. Here one
# program a token does both, after XLA's product for the logits. On an H200 (bench, prompt 128 +
# 256 new, alternating JAXLLM_ROUTE=xla, same run): Qwen3-30B-A3B at batch 1 2.452 and 2.450 ms a
# step against 2.632 and 2.637 (408 tok/s against 380), batch 8 9.258 against 9.417, batch 32
# 17.407 against 17.526, a 2048-token prefill 68.11 ms against 68.57; Mixtral-8x7B at batch 1
# 6.540 against 6.628. Measured and dropped beside it: the chosen experts' gate/up with SwiGLU,
# and their down with the weighted sum, as two kernels of `project`'s kind reading each expert's
# rows by its id, where XLA runs four kernels: Qwen3-30B-A3B at batch 1 2.520 and 2.515 ms a step
# against 2.451 and 2.447 (2 output rows a program; 4 rows of gate/up 2.569, 4 of down 2.648);
# and the router's product in the `add_norm` kernel before the layer, 2.5115 and 2.5043 against
# 2.4776 and 2.5170 (another machine), Mixtral-8x7B 6.4012 against 6.3494.
# "auto": the kernel on a GPU for float16/bfloat16 models; "xla" never; "interpret" in Pallas'
# interpreter (tests on the CPU).
ROUTE = env_choice("JAXLLM_ROUTE", MODES, "auto")


def route_mode(dtype) -> str | None:
    """"gpu", "interpret" or None (XLA): whether `route` takes its kernel."""
    return _mode(ROUTE, dtype)


def route(x_MD, router_ED, experts_per_token: int, norm_topk_prob: bool, *,
          mode: str | None = None):
    """(experts_MA int32, weights_MA float32) as `layers.route` gives them; with `mode` the
    router's logits from XLA's product, then `layers.pick_experts` in one kernel a token."""
    if mode is None:
        return L.route(x_MD, router_ED, experts_per_token, norm_topk_prob)
    return pick_experts(L.router_logits(x_MD, router_ED), experts_per_token, norm_topk_prob,
                        interpret=mode == "interpret")


@functools.partial(jax.jit, static_argnames=("experts_per_token", "norm_topk_prob", "interpret"))
def pick_experts(logits_ME, experts_per_token: int, norm_topk_prob: bool, *,
                 interpret: bool = False):
    """`layers.pick_experts` in one kernel a token."""
    M, E = logits_ME.shape
    A = experts_per_token
    trigger = _pdl_trigger(interpret) and M <= _multiprocessors()
    out = pl.BlockSpec((1, A), lambda m: (m, 0))
    return pl.pallas_call(
        functools.partial(_route_kernel, E=E, A=A, P=_pow2(E), Q=_pow2(A), norm=norm_topk_prob,
                          trigger=trigger),
        grid=(M,), in_specs=[pl.BlockSpec((1, E), lambda m: (m, 0))], out_specs=[out, out],
        out_shape=[jax.ShapeDtypeStruct((M, A), jnp.int32),
                   jax.ShapeDtypeStruct((M, A), jnp.float32)],
        compiler_params=plt.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret, name="route")(logits_ME)


def _route_kernel(logits_ref, experts_ref, weights_ref, *, E, A, P, Q, norm, trigger):
    """One token: its E logits (padded to P) through a float32 softmax, then A rounds each taking
    the largest probability left, the lowest id among equals (lax.top_k's order); its A ids and
    weights padded to Q. Arrays are [1, P] and [1, Q], a row as the refs hold it."""
    f32 = jnp.float32
    ids = jnp.arange(P, dtype=jnp.int32)[None, :]
    cols = ids < E
    if trigger:  # the signal's result used, so that the compiler keeps it
        cols = cols & (_launch_dependents(pl.program_id(0)) >= 0)
    logits = plt.load(logits_ref.at[pl.ds(0, 1), pl.ds(0, P)], mask=cols, other=0).astype(f32)
    logits = jnp.where(cols, logits, -jnp.inf)
    e = jnp.exp(logits - jnp.max(logits))  # exp(-inf) = 0 past E
    probs = e / jnp.sum(e)
    slots = jnp.arange(Q, dtype=jnp.int32)[None, :]
    left = jnp.where(cols, probs, -1.0)  # probabilities are >= 0 (NaN for a NaN row)
    experts, weights = jnp.zeros((1, Q), jnp.int32), jnp.zeros((1, Q), f32)
    for a in range(A):
        best = jnp.max(left)
        # A NaN row matches nothing: then expert E - 1, its weight NaN as XLA's would be.
        pick = jnp.minimum(jnp.min(jnp.where(left == best, ids, P)), E - 1)
        experts = jnp.where(slots == a, pick, experts)
        weights = jnp.where(slots == a, jnp.sum(jnp.where(ids == pick, probs, 0.0)), weights)
        left = jnp.where(ids == pick, -1.0, left)
    if norm:
        weights = weights / jnp.sum(weights)  # the slots past A hold 0
    at = (pl.ds(0, 1), pl.ds(0, Q))
    plt.store(experts_ref.at[at], experts, mask=slots < A)
    plt.store(weights_ref.at[at], weights, mask=slots < A)
