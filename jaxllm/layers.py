"""Pure array functions of one transformer block: norm, rotary embedding, attention, MLP.

No parameters objects here: every function takes arrays and returns arrays, so the same code
runs unsharded, inside `shard_map` (where N, K, F are per-device counts) and in tests.
"""

import jax
import jax.numpy as jnp


def rms_norm(x, weight, eps: float):
    """RMSNorm over the last axis, as transformers: statistics in float32, eps inside the rsqrt,
    the normalized value cast back to the input dtype before the weight multiplies it."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


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


def visible_mask(q_slots_T, start_B, num_slots: int, window: int | None):
    """[B, T, S] bool: query at cache slot q sees key slot s iff start_b <= s <= q (and q - s < window).

    Slots before a row's start hold left padding and are never seen. Positions and slots differ by
    the same per-row offset, so the sliding-window distance can be taken between slots.
    """
    s_S = jnp.arange(num_slots, dtype=jnp.int32)
    causal_TS = s_S[None, :] <= q_slots_T[:, None]
    if window is not None:
        causal_TS &= q_slots_T[:, None] - s_S[None, :] < window
    return causal_TS[None, :, :] & (s_S[None, None, :] >= start_B[:, None, None])


def attention(q_BTKGH, k_BKSH, v_BKSH, mask_BTS):
    """Grouped-query attention of T queries over S keys; softmax in float32.

    A query with no visible key (a padding position) gets uniform weights instead of NaN: its
    output is never read, and masking with the dtype's minimum rather than -inf keeps it finite.
    """
    scale = q_BTKGH.shape[-1] ** -0.5
    scores_BKGTS = jnp.einsum("BTKGH,BKSH->BKGTS", q_BTKGH, k_BKSH,
                              preferred_element_type=jnp.float32) * scale
    scores_BKGTS = jnp.where(mask_BTS[:, None, None], scores_BKGTS, jnp.finfo(jnp.float32).min)
    probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1).astype(v_BKSH.dtype)
    return jnp.einsum("BKGTS,BKSH->BTKGH", probs_BKGTS, v_BKSH)


def mlp(x_BTD, w_gate_up_DJF, w_down_FD):
    """SwiGLU: down(silu(gate(x)) * up(x)); gate and up are one fused matrix (J = 2)."""
    gate_up_BTJF = jnp.einsum("BTD,DJF->BTJF", x_BTD, w_gate_up_DJF)
    hidden_BTF = jax.nn.silu(gate_up_BTJF[:, :, 0]) * gate_up_BTJF[:, :, 1]
    return jnp.einsum("BTF,FD->BTD", hidden_BTF, w_down_FD)
