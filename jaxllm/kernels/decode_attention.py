"""Decode attention in one kernel: a new token per row is rotated, its k and v written at the row's
slot, and it attends over the row's live slots only, where XLA's masked form reads the whole cache
and ran nine small kernels (docs/decisions/decode-attention.md#one-kernel-a-layer)."""

import functools
import math

import jax
import jax.numpy as jnp
from flax import struct

from jaxllm import runtime
from jaxllm.kernels.common import pl, plt, NEG, dot_t, launch_dependents, pdl_trigger, pow2
from jaxllm.kernels.tuning import KernelTuning, current

QUERY_ROWS = 16  # the query tile: a KV head's G queries, padded to the smallest tensor-core dot
# `verify_attention`'s most query rows a program (T new tokens' G queries each, both padded to
# powers of two): its float32 sums, [rows, H], live in the program's registers.
VERIFY_QUERY_ROWS = 128


def supports(head_dim: int, rotary_dim: int, kv_int8: bool, cache_length: int, gpu: bool,
             tokens: int = 1, q_per_kv: int = 1) -> bool:
    """The kernel's hard limits: the whole head rotated (its halves power-of-two sized, at least 8;
    on a GPU at least 16, as tensor-core dots contract 16), a cache in the model dtype (not int8),
    and a cache length that is a multiple of 16 (its blocks of slots are tensor-core operands;
    `generate`'s bucketed lengths always are, a hand-made cache may not be). Several `tokens` a
    row (`verify_attention`, `q_per_kv` queries a KV head each): at most VERIFY_QUERY_ROWS query
    rows a program, half as many for heads of 256 (their float32 sums stay within the registers
    of 128 rows of 128)."""
    if kv_int8 or rotary_dim != head_dim or cache_length % 16:
        return False
    if head_dim % 2 or (head_dim // 2) & (head_dim // 2 - 1) or head_dim < 16:
        return False
    if tokens > 1 and math.prod(_query_tile(tokens, q_per_kv)) * max(head_dim, 128) > VERIFY_QUERY_ROWS * 128:
        return False
    return not (gpu and head_dim < 32)


def _query_tile(T: int, G: int) -> tuple[int, int]:
    """`verify_attention`'s query tile [Tq, Gp]: T tokens and G queries each, both to powers of
    two, at least QUERY_ROWS rows in all (the padding masked)."""
    Gp = pow2(G)
    return max(pow2(T), QUERY_ROWS // min(Gp, QUERY_ROWS)), Gp


def _offset_normed(x, w, offset: float, dtype):
    """A q/k half already times its inverse RMS (float32) through a (offset + w) norm, as
    `layers.rms_norm` with an offset rounds it: the product in float32, then the dtype."""
    return (x * (offset + w.astype(jnp.float32))).astype(dtype).astype(jnp.float32)


def _capped(s, softcap: float | None):
    """Scores soft-capped to tanh(s / c) * c where the model caps them (Gemma 2), as
    `layers.attention`; else s as it is."""
    return s if softcap is None else jnp.tanh(s / softcap) * softcap


def _block(length: int, tuning: KernelTuning) -> int:
    return min(tuning.block_slots, length & -length)


def _splits(B: int, K: int, H: int, S: int, block: int, split_slots: int,
            tuning: KernelTuning) -> tuple[int, int]:
    """(splits, span): how a (row, KV head)'s S cache slots divide over programs, each `span`
    slots (a whole number of blocks). One split where the grid alone fills the GPU, half-length
    ones where it is small (docs/decisions/decode-attention.md#one-split-where-the-grid-fills-the-gpu)."""
    cdiv = lambda a, b: -(-a // b)
    one_split = tuning.one_split_values
    if one_split and B * K * H >= one_split * runtime.multiprocessors():
        slots = S
    else:
        slots = split_slots if B * K * cdiv(S, split_slots) >= runtime.multiprocessors() else split_slots // 2
    splits = cdiv(S, slots)
    span = cdiv(cdiv(S, splits), block) * block
    return cdiv(S, span), span


# A decode step whose o projection takes `project`'s kernel may take the splits uncombined, the
# kernel combining them as it loads its input (docs/decisions/decode-attention.md#combining-the-splits).
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


@functools.partial(jax.jit, static_argnames=("window", "eps", "scale", "softcap", "norm_offset",
                                             "interpret", "split_out", "tuning"))
def decode_attention(qkv_BKJH, k_BKSH, v_BKSH, end_B, start_B, rotation_P2R, *,
                     window: int | None = None, q_norm_H=None, k_norm_H=None, eps: float = 1e-6,
                     scale: float | None = None, softcap: float | None = None,
                     norm_offset: float = 0.0, interpret: bool = False, split_out: bool = False,
                     tuning: KernelTuning | None = None):
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
    one lowering of the kernel. `tuning`: the tiles and splits (`tuning.current()` if None).
    As `layers.attention`, `scale` multiplies the scores (None: H^-1/2) and `softcap` c caps them
    to tanh(s / c) * c before the mask (Gemma 2); the q/k norms scale by (norm_offset + w), as
    `layers.rms_norm` with its offset (Gemma 3). Each is a static switch: off, the kernel's
    program is the one without it.
    """
    tuning = tuning or current()
    B, K, J, H = qkv_BKJH.shape
    S = k_BKSH.shape[2]
    G, R = J - 2, H // 2
    rows = max(QUERY_ROWS, pow2(G))
    block = _block(S, tuning)
    splits, span = _splits(B, K, H, S, block, tuning.split_slots, tuning)
    qk_norm = q_norm_H is not None
    kernel = functools.partial(_decode_attention_kernel, G=G, R=R, window=window, span=span,
                               block=block, splits=splits, eps=eps, qk_norm=qk_norm, P=rows,
                               trigger=pdl_trigger(interpret, tuning),
                               scale=H ** -0.5 if scale is None else scale, softcap=softcap,
                               norm_offset=norm_offset)
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
        compiler_params=plt.CompilerParams(num_warps=tuning.warps, num_stages=2),
        interpret=interpret, name="decode_attention")(*args)
    k_BKSH, v_BKSH = outs[n_out:]
    if splits == 1:
        return outs[0], k_BKSH, v_BKSH
    heads = SplitHeads(*outs[:n_out], dtype=qkv_BKJH.dtype)
    if split_out:
        return heads, k_BKSH, v_BKSH
    return heads.combined(), k_BKSH, v_BKSH


def _cached_blocks(q1, q2, k_ref, v_ref, first, last, carry, *, block: int, R: int, scale, softcap,
                   dtype, sees=None):
    """The online softmax over the cached slots [first, last), a block of slots at a time: the
    running (max [P], sum [P], weighted values [P, H]) `carry` of the P query rows (halves q1, q2)
    updated by two tensor-core dots a block. `sees(slot)` [P, block], where given, limits what
    each query row sees further (a verify step's per-token bounds)."""
    f32 = jnp.float32

    def body(i, carry):
        m, l, acc = carry
        base = pl.multiple_of(i * block, block)
        slot = base + jnp.arange(block)
        seen = ((slot >= first) & (slot < last))[None, :]
        if sees is not None:
            seen = sees(slot) & seen
        kb1 = k_ref[pl.ds(base, block), pl.ds(0, R)].astype(dtype)
        kb2 = k_ref[pl.ds(base, block), pl.ds(R, R)].astype(dtype)
        s = _capped((dot_t(q1, kb1) + dot_t(q2, kb2)) * scale, softcap)  # [P, block]
        s = jnp.where(seen, s, NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(seen, jnp.exp(s - m_new[:, None]), 0.0)
        correction = jnp.exp(m - m_new)
        vb = v_ref[pl.ds(base, block), :].astype(dtype)
        acc = acc * correction[:, None] + jnp.dot(p.astype(dtype), vb, preferred_element_type=f32)
        return m_new, l * correction + jnp.sum(p, axis=1), acc

    return jax.lax.fori_loop(first // block, jnp.maximum(first // block, -(-last // block)), body, carry)


def _decode_attention_kernel(end_ref, start_ref, rotation_ref, qkv_ref, k_ref, v_ref, *refs,
                             G, R, window, span, block, splits, eps, qk_norm, P, trigger, scale,
                             softcap, norm_offset):
    """One (row, KV head, split of the cache) program; see `decode_attention`.

    The G queries of the KV head sit in a tile of P >= 16 rows (the rest masked), so scores and
    the weighted sum are two tensor-core dots per block of slots, and the softmax two row
    reductions (docs/decisions/decode-attention.md#one-kernel-a-layer: vector reductions per query
    were several times slower).
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
        end = launch_dependents(end)
    lo = start if window is None else jnp.maximum(start, end + 1 - window)
    at = jnp.maximum(end - start, 0)  # the new token's position (left padding clamped to 0)
    cos, sin = rotation_ref[pl.ds(at, 1), pl.ds(0, R)], rotation_ref[pl.ds(at, 1), pl.ds(R, R)]
    is_query = jnp.arange(P) < G

    def rotated(x1, x2, norm_ref):  # float32 [rows, R] halves, normed (Qwen3) and rotated
        if norm_ref is not None and norm_offset:  # Gemma 3's (1 + w): as layers.rms_norm, in float32
            inv = jax.lax.rsqrt((jnp.sum(x1 * x1, axis=1) + jnp.sum(x2 * x2, axis=1)) / H + eps)
            x1, x2 = (_offset_normed(x * inv[:, None], norm_ref[pl.ds(at, R)][None, :], norm_offset, dtype)
                      for x, at in ((x1, 0), (x2, R)))
        elif norm_ref is not None:  # as layers.rms_norm: normalize in float32, weight in the dtype
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

    # 1.0 or 0.0 from integers: Pallas' Triton lowering took a bool -> float convert for a no-op.
    owned = (1 - jnp.minimum(jnp.abs(end // span - part), 1)).astype(f32)
    new_score = _capped((jnp.sum(q1.astype(f32) * k1.astype(f32), axis=1)
                         + jnp.sum(q2.astype(f32) * k2.astype(f32), axis=1)) * scale, softcap)
    m = jnp.where(owner, new_score, NEG)
    l = jnp.zeros((P,), f32) + owned
    acc = jnp.zeros((P, H), f32) + v.astype(f32) * owned

    # The cached slots of this split that the token sees: [lo, end) within the split's span.
    first = jnp.maximum(lo, part * span)
    last = jnp.minimum(end, (part + 1) * span)

    m, l, acc = _cached_blocks(q1, q2, k_ref, v_ref, first, last, (m, l, acc), block=block, R=R,
                               scale=scale, softcap=softcap, dtype=dtype)
    if splits == 1:
        (out_ref,) = out_refs
        plt.store(out_ref.at[pl.ds(0, P), :], (acc / l[:, None]).astype(out_ref.dtype),
                  mask=is_query[:, None])
    else:
        acc_ref, m_ref, l_ref = out_refs
        plt.store(acc_ref.at[pl.ds(0, P), :], acc, mask=is_query[:, None])
        plt.store(m_ref.at[pl.ds(0, P)], m, mask=is_query)
        plt.store(l_ref.at[pl.ds(0, P)], l, mask=is_query)


# A speculative verify step (issue 60) writes k+1 <= 9 tokens a row into a warm cache: XLA's
# prefill form read the whole cache and ran a kernel per small op, at 1.2-1.9x a decode step.
@functools.partial(jax.jit, static_argnames=("window", "eps", "scale", "softcap", "norm_offset",
                                             "interpret", "tuning"))
def verify_attention(qkv_BTKJH, k_BKSH, v_BKSH, end_B, start_B, rotation_P2R, *,
                     window: int | None = None, q_norm_H=None, k_norm_H=None, eps: float = 1e-6,
                     scale: float | None = None, softcap: float | None = None,
                     norm_offset: float = 0.0, interpret: bool = False,
                     tuning: KernelTuning | None = None):
    """`decode_attention` for T new tokens a row: token t of row b sits at slot end_b + t (position
    end_b + t - start_b, clamped to 0 as XLA's), is rotated and written there, and attends over
    the row's live cached slots (start_b .. end_b, within `window` of its own slot) and over the
    new tokens up to itself (causal among them).

    qkv [B, T, K, G+2, H] is the projection's output (per KV head G queries, k, v). Each
    (row, KV head, split) program takes the T tokens' T*G queries as rows of one tile, so the
    cache is read once for all of them; the new tokens' keys and values stay in registers (the
    program whose split holds slot end_b writes them and counts them in its sums). Returns
    (out [B, T, K, G, H], k, v), the splits combined by XLA. Scores, softmax and the weighted
    sums run in float32, the dots' operands in the model dtype. The caller guarantees
    end_b + T <= S. `tuning.verify_tiles`: blocks of slots, splits, warps. `scale`, `softcap`
    and `norm_offset` as `decode_attention`'s.
    """
    tuning = tuning or current()
    B, T, K, J, H = qkv_BTKJH.shape
    S = k_BKSH.shape[2]
    G, R = J - 2, H // 2
    Tq, Gp = _query_tile(T, G)
    block_slots, split_slots, warps = tuning.verify_tiles
    block = min(block_slots, S & -S)
    splits, span = _splits(B, K, H, S, block, split_slots, tuning)
    qk_norm = q_norm_H is not None
    kernel = functools.partial(_verify_attention_kernel, T=T, G=G, R=R, window=window, span=span,
                               block=block, splits=splits, eps=eps, qk_norm=qk_norm, Tq=Tq, Gp=Gp,
                               Tn=max(QUERY_ROWS, pow2(T)), trigger=pdl_trigger(interpret, tuning),
                               scale=H ** -0.5 if scale is None else scale, softcap=softcap,
                               norm_offset=norm_offset)
    row = lambda: pl.BlockSpec((1,), lambda b, k, s: (b,))
    head = lambda *block_shape: pl.BlockSpec((None, None, *block_shape), lambda b, k, s: (b, k, 0, 0))
    tokens = lambda *block_shape: pl.BlockSpec(  # [T, ...] of row b, KV head k
        (None, T, None, *block_shape), lambda b, k, s: (b, 0, k) + (0,) * len(block_shape))
    vector = pl.BlockSpec((H,), lambda b, k, s: (0,))
    rotation_P2R = rotation_P2R.reshape(rotation_P2R.shape[0], 2 * R)  # a row per position
    in_specs = [row(), row(), pl.BlockSpec(rotation_P2R.shape, lambda b, k, s: (0, 0)),
                tokens(J, H), head(S, H), head(S, H)] + [vector, vector] * qk_norm
    args = [end_B.astype(jnp.int32), start_B.astype(jnp.int32),
            rotation_P2R.astype(jnp.float32), qkv_BTKJH, k_BKSH, v_BKSH]
    args += [q_norm_H, k_norm_H] * qk_norm
    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct((B, T, K, G, H), qkv_BTKJH.dtype)]
        out_specs = [tokens(G, H)]
    else:  # per split: unnormalized sums, running maxima and denominators, as `SplitHeads`
        split = lambda *block_shape: pl.BlockSpec(
            (None, None, T, None, *block_shape), lambda b, k, s: (b, s, 0, k) + (0,) * len(block_shape))
        out_shape = [jax.ShapeDtypeStruct((B, splits, T, K, G, H), jnp.float32),
                     jax.ShapeDtypeStruct((B, splits, T, K, G), jnp.float32),
                     jax.ShapeDtypeStruct((B, splits, T, K, G), jnp.float32)]
        out_specs = [split(G, H), split(G), split(G)]
    n_out = len(out_shape)
    out_shape += [jax.ShapeDtypeStruct(k_BKSH.shape, k_BKSH.dtype),
                  jax.ShapeDtypeStruct(v_BKSH.shape, v_BKSH.dtype)]
    out_specs += [head(S, H), head(S, H)]
    outs = pl.pallas_call(
        kernel, grid=(B, K, splits), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        input_output_aliases={4: n_out, 5: n_out + 1},
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=2),
        interpret=interpret, name="verify_attention")(*args)
    k_BKSH, v_BKSH = outs[n_out:]
    if splits == 1:
        return outs[0], k_BKSH, v_BKSH
    return SplitHeads(*outs[:n_out], dtype=qkv_BTKJH.dtype).combined(), k_BKSH, v_BKSH


def _verify_attention_kernel(end_ref, start_ref, rotation_ref, qkv_ref, k_ref, v_ref, *refs,
                             T, G, R, window, span, block, splits, eps, qk_norm, Tq, Gp, Tn,
                             trigger, scale, softcap, norm_offset):
    """One (row, KV head, split of the cache) program of `verify_attention`.

    Query row i of the [Tq * Gp, H] tile is token i // Gp's query i % Gp (a power of two, so the
    3-D load reshapes in place); the new tokens' keys and values are a tile of Tn >= 16 rows, so
    their scores and weighted sum are tensor-core dots as a cached block's are.
    """
    if qk_norm:
        q_norm_ref, k_norm_ref, *refs = refs
    else:
        q_norm_ref = k_norm_ref = None
    out_refs, (k_out_ref, v_out_ref) = refs[:-2], refs[-2:]
    f32, dtype = jnp.float32, qkv_ref.dtype
    H, P = 2 * R, Tq * Gp
    part = pl.program_id(2)
    end, start = end_ref[0], start_ref[0]  # this row's first write slot and first live slot
    if trigger:
        end = launch_dependents(end)

    def table(rows):  # float32 cos and sin [rows, R] of new tokens 0 .. rows-1 (past T: clamped)
        at = jnp.clip(end - start + jnp.arange(rows), 0, rotation_ref.shape[0] - 1)[:, None]
        cols = jnp.arange(R)[None, :]
        return rotation_ref[at, cols], rotation_ref[at, cols + R]

    def rotated(x1, x2, norm_ref, cos, sin):  # float32 halves [..., R], normed (Qwen3), rotated
        if norm_ref is not None and norm_offset:  # Gemma 3's (1 + w): as layers.rms_norm, in float32
            inv = jax.lax.rsqrt((jnp.sum(x1 * x1, axis=-1) + jnp.sum(x2 * x2, axis=-1)) / H + eps)[..., None]
            x1, x2 = (_offset_normed(x * inv, norm_ref[pl.ds(at, R)], norm_offset, dtype)
                      for x, at in ((x1, 0), (x2, R)))
        elif norm_ref is not None:  # as layers.rms_norm: normalize in float32, weight in the dtype
            inv = jax.lax.rsqrt((jnp.sum(x1 * x1, axis=-1) + jnp.sum(x2 * x2, axis=-1)) / H + eps)[..., None]
            x1 = ((x1 * inv).astype(dtype) * norm_ref[pl.ds(0, R)]).astype(f32)
            x2 = ((x2 * inv).astype(dtype) * norm_ref[pl.ds(R, R)]).astype(f32)
        return x1 * cos - x2 * sin, x2 * cos + x1 * sin

    # The queries, [Tq, Gp, R] halves rotated by their token's position, then [P, R].
    is_query = (jnp.arange(Tq)[:, None] < T) & (jnp.arange(Gp)[None, :] < G)
    query_half = lambda at: plt.load(qkv_ref.at[pl.ds(0, Tq), pl.ds(0, Gp), pl.ds(at, R)],
                                     mask=is_query[:, :, None], other=0).astype(f32)
    cos, sin = table(Tq)
    q1, q2 = (half.astype(dtype).reshape(P, R) for half in rotated(
        query_half(0), query_half(R), q_norm_ref, cos[:, None, :], sin[:, None, :]))
    # The new tokens' keys and values, [Tn, ...], rows past T zero.
    new = jnp.arange(Tn) < T
    new_row = lambda j, at, n: plt.load(qkv_ref.at[pl.ds(0, Tn), jnp.int32(j), pl.ds(at, n)],
                                        mask=new[:, None], other=0).astype(f32)
    cos, sin = table(Tn)
    k1, k2 = (half.astype(k_ref.dtype) for half in rotated(
        new_row(G, 0, R), new_row(G, R, R), k_norm_ref, cos, sin))
    v = new_row(G + 1, 0, H).astype(v_ref.dtype)
    owner = end // span == part  # the split holding slot `end` writes the new tokens and counts them

    @pl.when(owner)
    def _():
        plt.store(k_out_ref.at[pl.ds(end, Tn), pl.ds(0, R)], k1, mask=new[:, None])
        plt.store(k_out_ref.at[pl.ds(end, Tn), pl.ds(R, R)], k2, mask=new[:, None])
        plt.store(v_out_ref.at[pl.ds(end, Tn), :], v, mask=new[:, None])

    q_slot = end + jnp.arange(P) // Gp  # each query row's own slot
    lo = start if window is None else jnp.maximum(start, q_slot + 1 - window)
    lo = jnp.zeros((P,), jnp.int32) + lo  # [P]: the first slot each query sees

    def sees(slot):  # [P, n] whether each query row sees these slots: live, causal, in its window
        return (slot[None, :] >= lo[:, None]) & (slot[None, :] <= q_slot[:, None])

    # The new tokens first: each query sees itself (so its sum is never empty, as with T = 1)
    # and the ones before it in its window.
    new_slot = end + jnp.arange(Tn)
    seen = (sees(new_slot) | (new_slot[None, :] == q_slot[:, None])) & new[None, :] & owner
    s = _capped((dot_t(q1, k1.astype(dtype)) + dot_t(q2, k2.astype(dtype))) * scale, softcap)  # [P, Tn]
    s = jnp.where(seen, s, NEG)
    m = jnp.max(s, axis=1)
    p = jnp.where(seen, jnp.exp(s - m[:, None]), 0.0)
    l = jnp.sum(p, axis=1)
    acc = jnp.dot(p.astype(dtype), v.astype(dtype), preferred_element_type=f32)

    # The cached slots of this split that some query sees (the first token's window reaches
    # furthest back): [first, end) within the split's span.
    first = jnp.maximum(start if window is None else jnp.maximum(start, end + 1 - window), part * span)
    last = jnp.minimum(end, (part + 1) * span)

    m, l, acc = _cached_blocks(q1, q2, k_ref, v_ref, first, last, (m, l, acc), block=block, R=R,
                               scale=scale, softcap=softcap, dtype=dtype, sees=sees)
    at = (pl.ds(0, Tq), pl.ds(0, Gp))
    if splits == 1:
        (out_ref,) = out_refs
        out = (acc / l[:, None]).astype(out_ref.dtype).reshape(Tq, Gp, H)
        plt.store(out_ref.at[(*at, slice(None))], out, mask=is_query[:, :, None])
    else:
        acc_ref, m_ref, l_ref = out_refs
        plt.store(acc_ref.at[(*at, slice(None))], acc.reshape(Tq, Gp, H), mask=is_query[:, :, None])
        plt.store(m_ref.at[at], m.reshape(Tq, Gp), mask=is_query)
        plt.store(l_ref.at[at], l.reshape(Tq, Gp), mask=is_query)
