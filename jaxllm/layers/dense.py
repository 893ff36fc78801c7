"""Pure array functions of one transformer block: norm, rotary embedding, attention, MLP.

No parameters objects here: every function takes arrays and returns arrays, so the same code
runs unsharded, inside `shard_map` (where N, K, F are per-device counts) and in tests.
"""

import jax
import jax.numpy as jnp

from jaxllm.env import env_choice
from jaxllm.layers.quant import QuantizedWeight
from jaxllm.runtime import gpu_generation


def rms_norm(x, weight, eps: float, offset: float = 0.0):
    """RMSNorm over the last axis, as transformers: statistics in float32, eps inside the rsqrt,
    the normalized value cast back to the input dtype before the weight multiplies it.

    With an `offset` (Gemma's 1) the scale is (offset + weight), and, as Gemma's RMSNorm does, the
    product is taken in float32 and only then cast to the input dtype.
    """
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if offset:
        return (normed * (offset + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * normed.astype(x.dtype)


# How a projection with one row of activations (batch-1 decode) is computed: "reduce" writes it as
# a float32 multiply + row reduction, which XLA emits as a bandwidth-bound reduction kernel; "dot"
# leaves it to XLA's GEMM emitter, whose [8, 64] output tiles streamed large matrices about half as
# fast (docs/decisions/loop-and-compiler.md#batch-1-products-as-reductions). JAXLLM_GEMV overrides
# it for benchmarking.
GEMV = env_choice("JAXLLM_GEMV", ("reduce", "dot"), "reduce")


def project(x_TC, w_OC, out_dtype=None):
    """x [..., C] @ w [O..., C]^T -> [..., O...]: every weight keeps its contraction axes minor.

    Axes of w before the last are outputs; a w whose last several axes are contracted is passed
    reshaped (a free reshape of a row-major array). Accumulates in float32.
    A `QuantizedWeight` is contracted as int8 values and its per-output scale applied to the
    float32 result (exact, the scale being constant along C): in the reduce form the int8 -> f32
    convert fuses into the reduction, so the kernel streams one byte per weight; in the dot form
    the values convert exactly to x's dtype (|q| <= 127 fits bf16's mantissa) for the GEMM.
    """
    C = x_TC.shape[-1]
    lead, outs = x_TC.shape[:-1], w_OC.shape[:-1]
    x_MC, w_NC = x_TC.reshape(-1, C), w_OC.reshape(-1, C)
    scale_N = None
    if isinstance(w_NC, QuantizedWeight):
        w_NC, scale_N = w_NC.q, w_NC.scale.reshape(-1)
    out_dtype = out_dtype or x_TC.dtype
    if x_MC.shape[0] == 1 and GEMV == "reduce":
        y_MN = jnp.sum(x_MC.astype(jnp.float32) * w_NC.astype(jnp.float32), axis=-1)[None]
    elif scale_N is None:
        # The GEMM writes out_dtype itself (accumulating in float32): a float32 result cast after
        # was a separate convert kernel (docs/decisions/loop-and-compiler.md#batch-1-products-as-reductions).
        y_MN = jnp.einsum("MC,NC->MN", x_MC, w_NC, preferred_element_type=out_dtype)
    else:
        y_MN = jnp.einsum("MC,NC->MN", x_MC, w_NC.astype(x_MC.dtype), preferred_element_type=jnp.float32)
    if scale_N is not None:
        y_MN = y_MN * scale_N
    return y_MN.astype(out_dtype).reshape(*lead, *outs)


def rope(x_BTNH, positions_BT, inv_freq, scale: float = 1.0):
    """Rotate the first 2*len(inv_freq) channels of each head (transformers' rotate_half layout).

    Angles are formed in float32 from integer positions: in bf16 they collapse at long context.
    """
    half = inv_freq.shape[0]
    angles_BTh = positions_BT.astype(jnp.float32)[..., None] * inv_freq
    cos = (jnp.cos(angles_BTh) * scale).astype(x_BTNH.dtype)[:, :, None, :]
    sin = (jnp.sin(angles_BTh) * scale).astype(x_BTNH.dtype)[:, :, None, :]
    x1, x2, rest = x_BTNH[..., :half], x_BTNH[..., half:2 * half], x_BTNH[..., 2 * half:]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return jnp.concatenate([rotated, rest], axis=-1) if rest.shape[-1] else rotated


def visible_mask(q_slots_BT, start_B, num_slots: int, window: int | None):
    """[B, T, S] bool: row b's query at cache slot q sees key slot s iff start_b <= s <= q (and
    q - s < window). q_slots_BT [B, T] holds each row's own query slots.

    Slots before a row's start hold left padding and are never seen, nor slots past the query,
    whatever stale values they hold. Positions and slots differ by the same per-row offset, so
    the sliding-window distance can be taken between slots.
    """
    s_S = jnp.arange(num_slots, dtype=jnp.int32)
    q_BTS = q_slots_BT[:, :, None]
    causal_BTS = s_S <= q_BTS
    if window is not None:
        causal_BTS &= q_BTS - s_S < window
    return causal_BTS & (s_S >= start_B[:, None, None])


def attention(q_BTKGH, k_BKSH, v_BKSH, mask_BTS, k_scale_BKS=None, v_scale_BKS=None, *,
              scale: float | None = None, softcap: float | None = None):
    """Grouped-query attention of T queries over S keys; softmax in float32.

    A query with no visible key (a padding position) gets uniform weights instead of NaN: its
    output is never read, and masking with the dtype's minimum rather than -inf keeps it finite.
    An int8 cache passes its per-slot scales: a slot's scale is constant along H, so it multiplies
    the scores (keys) and the probabilities (values) instead of a dequantized copy of the cache.
    `scale` multiplies the scores (default H^-1/2); `softcap` c then caps them to tanh(s / c) * c
    (Gemma 2), before the mask.
    """
    dtype = q_BTKGH.dtype
    scale = q_BTKGH.shape[-1] ** -0.5 if scale is None else scale
    scores_BKGTS = jnp.einsum("BTKGH,BKSH->BKGTS", q_BTKGH, k_BKSH.astype(dtype),
                              preferred_element_type=jnp.float32) * scale
    if k_scale_BKS is not None:
        scores_BKGTS = scores_BKGTS * k_scale_BKS[:, :, None, None, :]
    if softcap is not None:
        scores_BKGTS = jnp.tanh(scores_BKGTS / softcap) * softcap
    scores_BKGTS = jnp.where(mask_BTS[:, None, None], scores_BKGTS, jnp.finfo(jnp.float32).min)
    probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1)
    if v_scale_BKS is not None:
        probs_BKGTS = probs_BKGTS * v_scale_BKS[:, :, None, None, :]
    return jnp.einsum("BKGTS,BKSH->BTKGH", probs_BKGTS.astype(dtype), v_BKSH.astype(dtype))


# How a prefill into an empty cache attends (`causal_attention`): "cudnn" is cuDNN's fused flash
# attention through jax.nn.dot_product_attention, "xla" the masked einsum form of `attention`;
# "auto" takes cuDNN on a GPU when the dtype and head size allow. JAXLLM_ATTENTION overrides it.
ATTENTION = env_choice("JAXLLM_ATTENTION", ("auto", "cudnn", "xla"), "auto")


def uses_cudnn_attention(dtype, head_dim: int) -> bool:
    """Whether `causal_attention` takes cuDNN's fused kernel (never forming [T, T] scores)."""
    if ATTENTION != "auto":
        return ATTENTION == "cudnn"
    return (gpu_generation() >= 8 and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
            and head_dim % 8 == 0 and head_dim <= 128)


def causal_attention(q_BTNH, k_BTKH, v_BTKH, window: int | None = None, *,
                     scale: float | None = None, softcap: float | None = None):
    """Causal self-attention of T tokens among themselves (query t sees keys 0..t, the last
    `window` of them if given), for rows that start at index 0: any padding comes after a row's
    tokens, where causality already hides it. [B, T, N, H] out. `scale` and `softcap` as in
    `attention`.

    On a GPU this is cuDNN's flash attention, which never forms the [T, T] scores (the 8B
    shape's 2048-token prefill spent more time in masked XLA attention than in its matmuls);
    cuDNN has no soft cap, so capped scores (Gemma 2) take the XLA form.
    """
    if softcap is None and uses_cudnn_attention(q_BTNH.dtype, q_BTNH.shape[-1]):
        return jax.nn.dot_product_attention(
            q_BTNH, k_BTKH, v_BTKH, scale=scale, is_causal=True, implementation="cudnn",
            local_window_size=None if window is None else (window - 1, 0))
    B, T, N, H = q_BTNH.shape
    K = k_BTKH.shape[2]
    t_T = jnp.arange(T, dtype=jnp.int32)
    mask_1TS = visible_mask(t_T[None], jnp.zeros((1,), jnp.int32), T, window)
    out_BTKGH = attention(q_BTNH.reshape(B, T, K, N // K, H), k_BTKH.transpose(0, 2, 1, 3),
                          v_BTKH.transpose(0, 2, 1, 3), jnp.broadcast_to(mask_1TS, (B, T, T)),
                          scale=scale, softcap=softcap)
    return out_BTKGH.reshape(B, T, N, H)


def quantize_kv(x_BKTH):
    """int8 values and a float32 scale per (row, head, token): x ~= q * scale, |error| <= scale/2."""
    x32 = x_BKTH.astype(jnp.float32)
    scale_BKT = jnp.max(jnp.abs(x32), axis=-1) / 127.0
    scale_BKT = jnp.where(scale_BKT == 0, 1.0, scale_BKT)  # an all-zero vector stays exactly zero
    q_BKTH = jnp.clip(jnp.round(x32 / scale_BKT[..., None]), -127, 127).astype(jnp.int8)
    return q_BKTH, scale_BKT


# The gate's activation by `ModelConfig.activation`: SwiGLU's silu, GeGLU's GELU (Gemma's
# gelu_pytorch_tanh is the tanh approximation).
ACTIVATION = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
              "gelu": lambda x: jax.nn.gelu(x, approximate=False)}


def mlp(x_BTD, w_gate_up_JFD, w_down_DF, activation: str = "silu"):
    """Gated MLP: down(act(gate(x)) * up(x)), SwiGLU by default; gate and up are one fused matrix
    (J = 2)."""
    gate_up_BTJF = project(x_BTD, w_gate_up_JFD)
    hidden_BTF = ACTIVATION[activation](gate_up_BTJF[:, :, 0]) * gate_up_BTJF[:, :, 1]
    return project(hidden_BTF, w_down_DF)


def is_split(local: int, total: int) -> bool:
    """Inside shard_map: does a dimension of `local` entries hold only part of `total`?"""
    return local < total


def embed_lookup(embed_VD, tokens_BT, axis: str | None, vocab_size: int):
    """Rows of the embedding; with a vocab-split table, each device looks up the ids it holds
    (zeros for the others) and one psum assembles the rows (exact: a sum of one row and zeros)."""
    if axis is None or not is_split(embed_VD.shape[0], vocab_size):
        return embed_VD[tokens_BT]
    V_local = embed_VD.shape[0]
    local_BT = tokens_BT - jax.lax.axis_index(axis) * V_local
    mine_BT = (local_BT >= 0) & (local_BT < V_local)
    x_BTD = embed_VD[jnp.clip(local_BT, 0, V_local - 1)]
    return jax.lax.psum(jnp.where(mine_BT[..., None], x_BTD, jnp.zeros((), x_BTD.dtype)), axis)
