"""Pallas (Triton) kernels for the GPU decode step, where XLA's own fusions cost too many launches.

Measured on an H200 (bench traces, batch 1): a decode layer ran 17 kernels, and the 9 of them
between the qkv and o projections (rotary, two cache writes, scores, two softmax reductions, a
convert, the weighted sum, a concatenate) took 1-3 us each however small their work: 12 us of the
8B shape's 126 us layer and most of SmolLM2's 28 us one. `decode_attention` does that span in
one kernel, and reads only each row's live slots, where XLA's masked form reads the whole cache.
"""

import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

# "auto": the Pallas kernel on a GPU where `decode_attention_ok` holds, else XLA's masked form;
# "xla" never the kernel; "interpret" the kernel in Pallas' interpreter (tests on the CPU).
DECODE_ATTENTION = os.environ.get("JAXLLM_DECODE_ATTENTION", "auto")
BLOCK_SLOTS = 64  # cache slots per loop iteration (at most; a cache length's power-of-two factor)
SPLIT_SLOTS = 1024  # cache slots per program: longer caches split over programs, combined after
_NEG = -1e30  # an empty softmax's running maximum: finite, so exp(m - m) never forms inf - inf


def decode_attention_mode(dtype, head_dim: int, rotary_dim: int, kv_int8: bool) -> str | None:
    """"gpu", "interpret" or None (XLA's form): whether a decode step's attention takes the kernel.

    The kernel wants a float16/bfloat16 model (float32 models keep XLA's exact form), the whole
    head rotated (its halves power-of-two sized), and a cache in the model dtype.
    """
    if DECODE_ATTENTION == "xla" or kv_int8 or rotary_dim != head_dim:
        return None
    if head_dim % 2 or (head_dim // 2) & (head_dim // 2 - 1) or head_dim < 16:
        return None
    if DECODE_ATTENTION == "interpret":
        return "interpret"
    if jax.devices()[0].platform != "gpu" or jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        return None
    return "gpu"


def _block(length: int) -> int:
    return min(BLOCK_SLOTS, length & -length)


@functools.partial(jax.jit, static_argnames=("window", "eps", "interpret"))
def decode_attention(qkv_BKJH, k_BKSH, v_BKSH, cursor, start_B, cos_BR, sin_BR, *,
                     window: int | None = None, q_norm_H=None, k_norm_H=None, eps: float = 1e-6,
                     interpret: bool = False):
    """One new token per row, in one kernel: rotate its q and k, write k and v at slot `cursor`,
    and attend over the row's live slots (start_b .. cursor, the last `window` if given).

    qkv [B, K, G+2, H] is the projection's output per KV head (G queries, then k, then v), before
    the optional per-head RMSNorm (Qwen3's q_norm/k_norm, [H]) and the rotation, whose cos and sin
    [B, H/2] (float32, any attention factor included) are the new token's. The caches [B, K, S, H]
    are updated in place (their buffers aliased to the outputs). Returns (out [B, K, G, H], k, v).
    Scores, softmax and the weighted sum run in float32. Jitted, so the layers of a model share
    one lowering of the kernel.
    """
    B, K, J, H = qkv_BKJH.shape
    S = k_BKSH.shape[2]
    G, R = J - 2, H // 2
    block = _block(S)
    splits = max(1, -(-S // SPLIT_SLOTS))
    span = -(-(-(-S // splits)) // block) * block  # slots per split, a whole number of blocks
    splits = -(-S // span)
    qk_norm = q_norm_H is not None
    kernel = functools.partial(_decode_attention_kernel, G=G, R=R, window=window, span=span,
                               block=block, splits=splits, eps=eps, qk_norm=qk_norm)
    row = lambda *block_shape: pl.BlockSpec(block_shape, lambda b, k, s: (b,) + (0,) * (len(block_shape) - 1))
    head = lambda *block_shape: pl.BlockSpec((None, None, *block_shape), lambda b, k, s: (b, k, 0, 0))
    vector = pl.BlockSpec((H,), lambda b, k, s: (0,))
    in_specs = [pl.BlockSpec((1,), lambda b, k, s: (0,)), row(1), row(1, R), row(1, R),
                head(J, H), head(S, H), head(S, H)] + [vector, vector] * qk_norm
    args = [jnp.reshape(cursor, (1,)).astype(jnp.int32), start_B.astype(jnp.int32),
            cos_BR.astype(jnp.float32), sin_BR.astype(jnp.float32), qkv_BKJH, k_BKSH, v_BKSH]
    args += [q_norm_H, k_norm_H] * qk_norm
    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct((B, K, G, H), qkv_BKJH.dtype)]
        out_specs = [head(G, H)]
    else:  # per split: unnormalized sums, running maxima and denominators, combined below
        split = lambda *block_shape: pl.BlockSpec((None, None, None, *block_shape),
                                                  lambda b, k, s: (b, k, s) + (0,) * len(block_shape))
        out_shape = [jax.ShapeDtypeStruct((B, K, splits, G, H), jnp.float32),
                     jax.ShapeDtypeStruct((B, K, splits, G), jnp.float32),
                     jax.ShapeDtypeStruct((B, K, splits, G), jnp.float32)]
        out_specs = [split(G, H), split(G), split(G)]
    n_out = len(out_shape)
    out_shape += [jax.ShapeDtypeStruct(k_BKSH.shape, k_BKSH.dtype),
                  jax.ShapeDtypeStruct(v_BKSH.shape, v_BKSH.dtype)]
    out_specs += [head(S, H), head(S, H)]
    outs = pl.pallas_call(
        kernel, grid=(B, K, splits), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        input_output_aliases={5: n_out, 6: n_out + 1},
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret, name="decode_attention")(*args)
    k_BKSH, v_BKSH = outs[n_out:]
    if splits == 1:
        return outs[0], k_BKSH, v_BKSH
    acc_BKPGH, m_BKPG, l_BKPG = outs[:n_out]
    w_BKPG = jnp.exp(m_BKPG - jnp.max(m_BKPG, axis=2, keepdims=True))
    out_BKGH = (jnp.sum(acc_BKPGH * w_BKPG[..., None], axis=2)
                / jnp.sum(l_BKPG * w_BKPG, axis=2)[..., None])
    return out_BKGH.astype(qkv_BKJH.dtype), k_BKSH, v_BKSH


def _decode_attention_kernel(cursor_ref, start_ref, cos_ref, sin_ref, qkv_ref, k_ref, v_ref, *refs,
                             G, R, window, span, block, splits, eps, qk_norm):
    """One (row, KV head, split of the cache) program; see `decode_attention`."""
    if qk_norm:
        q_norm_ref, k_norm_ref, *refs = refs
    else:
        q_norm_ref = k_norm_ref = None
    out_refs, (k_out_ref, v_out_ref) = refs[:-2], refs[-2:]
    f32, dtype = jnp.float32, qkv_ref.dtype
    H = 2 * R
    part = pl.program_id(2)
    cursor, start = cursor_ref[0], start_ref[0]
    lo = start if window is None else jnp.maximum(start, cursor + 1 - window)
    cos, sin = cos_ref[0, :], sin_ref[0, :]

    def rotated(j, norm_ref):  # float32 halves of head row j, normed (Qwen3) and rotated
        x1 = qkv_ref[j, pl.ds(0, R)].astype(f32)
        x2 = qkv_ref[j, pl.ds(R, R)].astype(f32)
        if norm_ref is not None:  # as layers.rms_norm: normalize in float32, weight in the dtype
            inv = jax.lax.rsqrt((jnp.sum(x1 * x1) + jnp.sum(x2 * x2)) / H + eps)
            x1 = ((x1 * inv).astype(dtype) * norm_ref[pl.ds(0, R)]).astype(f32)
            x2 = ((x2 * inv).astype(dtype) * norm_ref[pl.ds(R, R)]).astype(f32)
        return x1 * cos - x2 * sin, x2 * cos + x1 * sin

    scale = H ** -0.5
    q = [tuple(half * scale for half in rotated(g, q_norm_ref)) for g in range(G)]
    k1, k2 = (half.astype(k_ref.dtype) for half in rotated(G, k_norm_ref))
    v = qkv_ref[G + 1, :].astype(v_ref.dtype)
    owner = cursor // span == part  # the split holding the new token writes and counts it

    @pl.when(owner)
    def _():
        k_out_ref[pl.ds(cursor, 1), pl.ds(0, R)] = k1[None, :]
        k_out_ref[pl.ds(cursor, 1), pl.ds(R, R)] = k2[None, :]
        v_out_ref[pl.ds(cursor, 1), :] = v[None, :]

    k1, k2, v = k1.astype(f32), k2.astype(f32), v.astype(f32)
    m = [jnp.where(owner, jnp.sum(q1 * k1) + jnp.sum(q2 * k2), _NEG) for q1, q2 in q]
    # 1.0 or 0.0 from integers: Pallas' Triton lowering took a bool -> float convert for a no-op.
    owned = (1 - jnp.minimum(jnp.abs(cursor // span - part), 1)).astype(f32)
    l = [owned for _ in range(G)]
    acc = [v * owned for _ in range(G)]

    # The cached slots of this split that the token sees: [lo, cursor) within the split's span.
    first = jnp.maximum(lo, part * span)
    last = jnp.minimum(cursor, (part + 1) * span)

    def body(i, carry):
        m, l, acc = carry
        base = pl.multiple_of(i * block, block)
        slot = base + jnp.arange(block)
        seen = (slot >= first) & (slot < last)
        kb1 = k_ref[pl.ds(base, block), pl.ds(0, R)].astype(f32)
        kb2 = k_ref[pl.ds(base, block), pl.ds(R, R)].astype(f32)
        vb = v_ref[pl.ds(base, block), :].astype(f32)
        m2, l2, acc2 = [], [], []
        for g, (q1, q2) in enumerate(q):
            s = jnp.sum(kb1 * q1[None, :], axis=1) + jnp.sum(kb2 * q2[None, :], axis=1)
            s = jnp.where(seen, s, _NEG)
            m_new = jnp.maximum(m[g], jnp.max(s))
            p = jnp.where(seen, jnp.exp(s - m_new), 0.0)
            correction = jnp.exp(m[g] - m_new)
            m2.append(m_new)
            l2.append(l[g] * correction + jnp.sum(p))
            acc2.append(acc[g] * correction + jnp.sum(p[:, None] * vb, axis=0))
        return m2, l2, acc2

    m, l, acc = jax.lax.fori_loop(first // block, jnp.maximum(first // block, -(-last // block)),
                                  body, (m, l, acc))
    if splits == 1:
        (out_ref,) = out_refs
        for g in range(G):
            out_ref[g, :] = (acc[g] / l[g]).astype(out_ref.dtype)
    else:
        acc_ref, m_ref, l_ref = out_refs
        for g in range(G):
            acc_ref[g, :] = acc[g]
            m_ref[g] = m[g]
            l_ref[g] = l[g]
