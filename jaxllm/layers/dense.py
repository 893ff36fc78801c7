"""Pure array functions of one transformer block: norm, rotary embedding, attention, MLP.

No parameters objects here: every function takes arrays and returns arrays, so the same code
runs unsharded, inside `shard_map` (where N, K, F are per-device counts) and in tests.
"""

import functools

import jax
import jax.numpy as jnp

from jaxllm.env import env_choice, env_flag
from jaxllm.layers.quant import QuantizedWeight


def rms_norm(x, weight, eps: float):
    """RMSNorm over the last axis, as transformers: statistics in float32, eps inside the rsqrt,
    the normalized value cast back to the input dtype before the weight multiplies it."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


# How a projection with one row of activations (batch-1 decode) is computed: "reduce" writes it as
# a float32 multiply + row reduction, which XLA emits as a bandwidth-bound reduction kernel; "dot"
# leaves it to XLA's GEMM emitter, whose [8, 64] output tiles streamed the 8B shape's gate/up and
# down weights at ~2 TB/s on an H200. JAXLLM_GEMV overrides it for benchmarking.
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
        # was a separate convert kernel, 83 us of the 8B shape's 1.5 ms prefill layer on an H200.
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


def attention(q_BTKGH, k_BKSH, v_BKSH, mask_BTS, k_scale_BKS=None, v_scale_BKS=None):
    """Grouped-query attention of T queries over S keys; softmax in float32.

    A query with no visible key (a padding position) gets uniform weights instead of NaN: its
    output is never read, and masking with the dtype's minimum rather than -inf keeps it finite.
    An int8 cache passes its per-slot scales: a slot's scale is constant along H, so it multiplies
    the scores (keys) and the probabilities (values) instead of a dequantized copy of the cache.
    """
    dtype = q_BTKGH.dtype
    scale = q_BTKGH.shape[-1] ** -0.5
    scores_BKGTS = jnp.einsum("BTKGH,BKSH->BKGTS", q_BTKGH, k_BKSH.astype(dtype),
                              preferred_element_type=jnp.float32) * scale
    if k_scale_BKS is not None:
        scores_BKGTS = scores_BKGTS * k_scale_BKS[:, :, None, None, :]
    scores_BKGTS = jnp.where(mask_BTS[:, None, None], scores_BKGTS, jnp.finfo(jnp.float32).min)
    probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1)
    if v_scale_BKS is not None:
        probs_BKGTS = probs_BKGTS * v_scale_BKS[:, :, None, None, :]
    return jnp.einsum("BKGTS,BKSH->BTKGH", probs_BKGTS.astype(dtype), v_BKSH.astype(dtype))


# How a prefill into an empty cache attends (`causal_attention`): "cudnn" is cuDNN's fused flash
# attention through jax.nn.dot_product_attention, "xla" the masked einsum form of `attention`;
# "auto" takes cuDNN on a GPU when the dtype and head size allow. JAXLLM_ATTENTION overrides it.
ATTENTION = env_choice("JAXLLM_ATTENTION", ("auto", "cudnn", "xla"), "auto")


def gpu_generation() -> int:
    """The default device's compute capability major (8 Ampere, 9 Hopper), 0 if not a GPU."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return 0
    return int(str(getattr(device, "compute_capability", "0")).split(".")[0] or 0)


def uses_cudnn_attention(dtype, head_dim: int) -> bool:
    """Whether `causal_attention` takes cuDNN's fused kernel (never forming [T, T] scores)."""
    if ATTENTION != "auto":
        return ATTENTION == "cudnn"
    return (gpu_generation() >= 8 and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
            and head_dim % 8 == 0 and head_dim <= 128)


def causal_attention(q_BTNH, k_BTKH, v_BTKH, window: int | None = None):
    """Causal self-attention of T tokens among themselves (query t sees keys 0..t, the last
    `window` of them if given), for rows that start at index 0: any padding comes after a row's
    tokens, where causality already hides it. [B, T, N, H] out.

    On a GPU this is cuDNN's flash attention, which never forms the [T, T] scores (the 8B
    shape's 2048-token prefill spent more time in masked XLA attention than in its matmuls).
    """
    if uses_cudnn_attention(q_BTNH.dtype, q_BTNH.shape[-1]):
        return jax.nn.dot_product_attention(
            q_BTNH, k_BTKH, v_BTKH, is_causal=True, implementation="cudnn",
            local_window_size=None if window is None else (window - 1, 0))
    B, T, N, H = q_BTNH.shape
    K = k_BTKH.shape[2]
    t_T = jnp.arange(T, dtype=jnp.int32)
    mask_1TS = visible_mask(t_T[None], jnp.zeros((1,), jnp.int32), T, window)
    out_BTKGH = attention(q_BTNH.reshape(B, T, K, N // K, H), k_BTKH.transpose(0, 2, 1, 3),
                          v_BTKH.transpose(0, 2, 1, 3), jnp.broadcast_to(mask_1TS, (B, T, T)))
    return out_BTKGH.reshape(B, T, N, H)


def quantize_kv(x_BKTH):
    """int8 values and a float32 scale per (row, head, token): x ~= q * scale, |error| <= scale/2."""
    x32 = x_BKTH.astype(jnp.float32)
    scale_BKT = jnp.max(jnp.abs(x32), axis=-1) / 127.0
    scale_BKT = jnp.where(scale_BKT == 0, 1.0, scale_BKT)  # an all-zero vector stays exactly zero
    q_BKTH = jnp.clip(jnp.round(x32 / scale_BKT[..., None]), -127, 127).astype(jnp.int8)
    return q_BKTH, scale_BKT


def mlp(x_BTD, w_gate_up_JFD, w_down_DF):
    """SwiGLU: down(silu(gate(x)) * up(x)); gate and up are one fused matrix (J = 2)."""
    gate_up_BTJF = project(x_BTD, w_gate_up_JFD)
    hidden_BTF = jax.nn.silu(gate_up_BTJF[:, :, 0]) * gate_up_BTJF[:, :, 1]
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


# Mixture of experts. Two more letters for routed tokens: M = B*T tokens in one row, and
# R = M*A (token, expert) assignments. Inside shard_map over an expert axis, E is the per-device
# expert count while the router still scores all experts.

# The path choice, made statically from shapes (`moe_path`): decode steps of up to this many
# tokens may take the dense path.
DENSE_MAX_TOKENS = 128


def route(x_MD, router_ED, experts_per_token: int, norm_topk_prob: bool):
    """The top-A experts of each token and their float32 weights, as transformers routes:
    logits in the model dtype (its linear layer), softmax in float32, top-A of the probabilities,
    renormalized to sum 1 when norm_topk_prob (Mixtral always is).

    Exactly equal probabilities go to the lower expert id (lax.top_k is stable), as in vLLM's fused
    top-k kernel. torch.topk leaves that order unspecified (on the CPU it is an artifact of
    std::nth_element), so no rule can match it everywhere. Ties are real in bf16 checkpoints,
    whose router logits often collide; they decide only which expert wins the last slot.
    Returns (experts_MA int32, weights_MA float32).
    """
    return pick_experts(router_logits(x_MD, router_ED), experts_per_token, norm_topk_prob)


def router_logits(x_MD, router_ED):
    """[M, E] in the model dtype: the router's linear layer (no bias)."""
    return jnp.einsum("MD,ED->ME", x_MD, router_ED)


def pick_experts(logits_ME, experts_per_token: int, norm_topk_prob: bool):
    """`route` from the router's logits: (experts_MA int32, weights_MA float32)."""
    probs_ME = jax.nn.softmax(logits_ME.astype(jnp.float32), axis=-1)
    weights_MA, experts_MA = jax.lax.top_k(probs_ME, experts_per_token)
    if norm_topk_prob:
        weights_MA = weights_MA / jnp.sum(weights_MA, axis=-1, keepdims=True)
    return experts_MA.astype(jnp.int32), weights_MA


def moe_path(tokens: int, experts_per_token: int, num_experts: int, decode: bool = False) -> str:
    """"gather", "dense" or "ragged" for a step of `tokens` tokens over `num_experts` (local) experts.

    - gather: while the M*A assignments are at most E, each reads its own expert's weights, so a
      step reads at most what one pass over all experts would, and only chosen experts: decode at
      small batch (Mixtral, E 8 A 2, up to 4 tokens; Qwen3-30B-A3B, E 128 A 8, up to 16).
    - dense: a decode step with more assignments than experts, up to DENSE_MAX_TOKENS tokens.
      Every expert is read once and multiplies every token, its output weighted 0 unless chosen:
      M FLOPs per weight byte keeps it bound by the same bytes grouping would read (which touches
      most experts once M*A > E), without a sort, permutations or a grouped-GEMM launch. On an
      H200 at the Mixtral shape, batch 8: 0.72 ms a layer against 2.25 ms for XLA's ragged_dot.
    - ragged: prefill and big batches: assignments sorted by expert, one grouped matmul; never a
      dense compute over all experts for every prompt token.
    """
    if tokens * experts_per_token <= num_experts:
        return "gather"
    if decode and tokens <= DENSE_MAX_TOKENS:
        return "dense"
    return "ragged"


def _gathered_project(x_MD, w_EOC, experts_MA):
    """[M, A, O...]: token m times the weight of each of its experts, w [E, O..., C] (C minor).

    A float32 multiply + reduction over C with the experts' rows gathered inside it: XLA fuses
    the gather into the reduction (as `project` does for batch-1 rows), so each chosen matrix
    streams from memory once; a gather feeding a dot first copied the matrices out, 3x the
    traffic (Mixtral shape on an H200: 0.68 -> 0.22 ms a layer). int8 weights convert in the
    same kernel and take their scales on the output.
    """
    scale = None
    if isinstance(w_EOC, QuantizedWeight):
        w_EOC, scale = w_EOC.q, w_EOC.scale
    (M, A), outs, C = experts_MA.shape, w_EOC.shape[1:-1], w_EOC.shape[-1]
    # R = A * outputs, flat: XLA's CPU YNNPACK fusion computed the same product written with
    # separate A and output axes wrongly when the gather folds to a broadcast (one local expert).
    w_MRC = w_EOC[experts_MA].reshape(M, -1, C)
    y_MR = jnp.sum(x_MD.astype(jnp.float32)[:, None, :] * w_MRC.astype(jnp.float32), axis=-1)
    y_MAO = y_MR.reshape(M, A, *outs)
    if scale is not None:
        y_MAO = y_MAO * scale[experts_MA]
    return y_MAO.astype(x_MD.dtype)


# The gather path's gate and up sums as one variadic reduction, SwiGLU made on its sums
# (`_gathered_swiglu`), where the sums were one reduction's outputs and SwiGLU another kernel's
# work. The same bits: each sum is rounded to x's dtype before silu, as before. On an H200 the
# experts' gate/up and SwiGLU in chains of 16 Qwen3-30B-A3B layers took 16.1-16.7 us a layer
# against 17.0-17.5, in as many kernels: the variadic reduction streams the gathered rows faster.
# Whole steps at batch 1 (bench, alternating, `.device/run139.sh`): Qwen3-30B-A3B 2.4043 and
# 2.3994 ms against 2.4524 and 2.4455 (416 tok/s against 408), Mixtral-8x7B 6.528 against 6.575.
# Dense models' one-row gate/up keep the one reduction: the 8B shape's took 57.0-57.6 us against
# 56.2-56.5 in chains, and a step of Llama-3.2-1B 0.8162 ms against 0.8039 (`.device/run138.sh`).
# JAXLLM_MOE_SWIGLU_REDUCE=0 turns it off.
MOE_SWIGLU_REDUCE = env_flag("JAXLLM_MOE_SWIGLU_REDUCE", True)


def _gathered_swiglu(x_MD, gate_up_EJFD, experts_MA):
    """[M, A, F]: SwiGLU of token m through each of its experts' gate/up [E, 2, F, C], gathered
    as `_gathered_project` does, in one variadic reduction unless MOE_SWIGLU_REDUCE is off."""
    if not MOE_SWIGLU_REDUCE:
        gate_up_MAJF = _gathered_project(x_MD, gate_up_EJFD, experts_MA)
        return jax.nn.silu(gate_up_MAJF[:, :, 0]) * gate_up_MAJF[:, :, 1]
    w_EJFC, scale = gate_up_EJFD, None
    if isinstance(w_EJFC, QuantizedWeight):
        w_EJFC, scale = w_EJFC.q, w_EJFC.scale
    x32_M11C = x_MD.astype(jnp.float32)[:, None, None, :]
    w_MAJFC = w_EJFC[experts_MA]
    scale_JMAF = None if scale is None else jnp.moveaxis(scale[experts_MA], 2, 0)
    products = tuple(x32_M11C * w_MAJFC[:, :, j].astype(jnp.float32) for j in (0, 1))
    zero = jnp.zeros((), jnp.float32)
    gate_MAF, up_MAF = jax.lax.reduce(products, (zero, zero),
                                      lambda a, b: (a[0] + b[0], a[1] + b[1]), (3,))
    if scale_JMAF is not None:
        gate_MAF, up_MAF = gate_MAF * scale_JMAF[0], up_MAF * scale_JMAF[1]
    return jax.nn.silu(gate_MAF.astype(x_MD.dtype)) * up_MAF.astype(x_MD.dtype)


def _experts_gather(x_MD, experts_MA, gate_up_EJFD, down_EDF):
    """SwiGLU of each token through each of its experts, the experts' weights gathered: [M, A, D]."""
    hidden_MAF = _gathered_swiglu(x_MD, gate_up_EJFD, experts_MA)
    M, A, F = hidden_MAF.shape
    out_RD = _gathered_project(hidden_MAF.reshape(M * A, F), down_EDF, experts_MA.reshape(M * A, 1))
    return out_RD.reshape(M, A, -1)


def _experts_matmul(spec: str, x, w_ENK):
    """einsum(spec, x, w) -> [M, E, N] float32, w [E, N, K] (contraction K minor) float or int8;
    an int8 w contracts its values (exact in x's dtype) and scales the output per (e, n)."""
    if not isinstance(w_ENK, QuantizedWeight):
        return jnp.einsum(spec, x, w_ENK, preferred_element_type=jnp.float32)
    y_MEN = jnp.einsum(spec, x, w_ENK.q.astype(x.dtype), preferred_element_type=jnp.float32)
    return y_MEN * w_ENK.scale


def _experts_dense(x_MD, experts_MA, weights_MA, gate_up_EJFD, down_EDF):
    """The weighted sum over each token's experts, [M, D] float32, computing all E experts per
    token and weighting the unchosen ones 0 (ids past E, another device's, weigh 0 too)."""
    M, A = experts_MA.shape
    E, J, F, D = gate_up_EJFD.shape
    w_ME = jnp.zeros((M, E + 1), jnp.float32).at[jnp.arange(M)[:, None], experts_MA].add(
        weights_MA)[:, :E]
    gate_up_MEJF = _experts_matmul("MK,ENK->MEN", x_MD,
                                   gate_up_EJFD.reshape(E, J * F, D)).reshape(M, E, J, F)
    hidden_MEF = (jax.nn.silu(gate_up_MEJF[:, :, 0]) * gate_up_MEJF[:, :, 1]).astype(x_MD.dtype)
    out_MED = _experts_matmul("MEK,ENK->MEN", hidden_MEF, down_EDF)
    # Through the model dtype, as each expert's output is in the gather and ragged paths.
    return jnp.einsum("MED,ME->MD", out_MED.astype(x_MD.dtype).astype(jnp.float32), w_ME)


def _grouped_matmul(x_RK, w_ENK, group_sizes_E):
    """[R, N]: rows of x in consecutive groups, group e times w[e] (contraction axis K minor).

    On a Hopper GPU, bf16/f16 weights go through jax's Pallas Mosaic GPU grouped GEMM
    (ragged_dot_mgpu): at the Mixtral shape's 2048-token prefill 4.5 ms a layer against 15.6 ms
    for XLA's ragged_dot, which XLA's GPU compiler (per its source) expands over all E groups;
    --xla_gpu_experimental_use_ragged_dot_fusion changed nothing there. Elsewhere, and
    for int8 weights, jax.lax.ragged_dot (on the CPU lowered densely, which only tests run).
    A `QuantizedWeight` w multiplies its int8 values (converted to x's dtype) and scales each row
    of the result by its group's per-output scales.
    """
    if _mgpu_ok(x_RK, w_ENK):
        return _mgpu_ragged_dot()(x_RK, w_ENK, group_sizes=group_sizes_E)
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0])
    if not isinstance(w_ENK, QuantizedWeight):
        return jax.lax.ragged_dot_general(x_RK, w_ENK, group_sizes_E, dims)
    y_RN = jax.lax.ragged_dot_general(x_RK, w_ENK.q.astype(x_RK.dtype), group_sizes_E, dims,
                                      preferred_element_type=jnp.float32)
    # Row r is in group e when it is past the first e groups; rows past all groups (ids the
    # caller masks) take the last group's scales.
    group_R = jnp.searchsorted(jnp.cumsum(group_sizes_E), jnp.arange(x_RK.shape[0]), side="right")
    scale_RN = w_ENK.scale[jnp.minimum(group_R, w_ENK.shape[0] - 1)]
    return (y_RN * scale_RN).astype(x_RK.dtype)


# Tiles of the Mosaic GPU grouped GEMM (the one configuration measured, at the Mixtral shape on
# an H200: not tuned), and whether it may be used at all (JAXLLM_GROUPED_GEMM=xla turns it off).
MGPU_TILES = dict(block_m=64, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1)
GROUPED_GEMM = env_choice("JAXLLM_GROUPED_GEMM", ("auto", "xla"), "auto")


@functools.cache
def _mgpu_ragged_dot():
    """The Mosaic GPU grouped GEMM under one jit: the layers' calls of one shape share a single
    lowering of the Pallas kernel. Lowered at each call site instead, the Mixtral shape's 64
    sites took 80 s to compile (about 1 s each)."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    return jax.jit(functools.partial(ragged_dot_mgpu.ragged_dot, **MGPU_TILES, transpose_rhs=True))


def _mgpu_ok(x_RK, w_ENK) -> bool:
    if GROUPED_GEMM != "auto" or isinstance(w_ENK, QuantizedWeight):
        return False
    E, N, K = w_ENK.shape
    return (gpu_generation() == 9 and x_RK.dtype == w_ENK.dtype
            and x_RK.dtype in (jnp.bfloat16, jnp.float16)
            and K % MGPU_TILES["block_k"] == 0 and N % MGPU_TILES["block_n"] == 0)


def _experts_ragged(x_MD, experts_MA, gate_up_EJFD, down_EDF):
    """The same [M, A, D], with the assignments sorted by expert and each expert's rows one group of
    a grouped matmul. An id of E (not a local expert) sorts after every group; those rows are
    outside all groups and come back as zeros or garbage, for the caller to mask."""
    M, A = experts_MA.shape
    E, J, F, D = gate_up_EJFD.shape
    experts_R = experts_MA.reshape(M * A)
    order_R = jnp.argsort(experts_R, stable=True)
    group_sizes_E = jnp.bincount(experts_R, length=E + 1)[:E].astype(jnp.int32)
    x_RD = x_MD[order_R // A]
    gate_up_RJF = _grouped_matmul(x_RD, gate_up_EJFD.reshape(E, J * F, D),
                                  group_sizes_E).reshape(M * A, J, F)
    hidden_RF = jax.nn.silu(gate_up_RJF[:, 0]) * gate_up_RJF[:, 1]
    out_RD = _grouped_matmul(hidden_RF, down_EDF, group_sizes_E)
    # Back to (token, slot) order by a gather through the inverse permutation (no scatter-add).
    inverse_R = jnp.zeros_like(order_R).at[order_R].set(jnp.arange(M * A, dtype=order_R.dtype))
    return out_RD[inverse_R].reshape(M, A, D)


def moe(x_BTD, router_ED, experts_gate_up_EJFD, experts_down_EDF, experts_per_token: int,
        norm_topk_prob: bool, *, path: str | None = None, expert_axis: str | None = None,
        routes=None):
    """Sparse SwiGLU mixture of experts: each token through its top-A experts, weighted.

    The path follows `moe_path` (`path` forces "gather", "dense" or "ragged"). The
    A expert outputs are weighted and summed in float32 and cast back once (transformers adds
    them one by one in the model dtype). With `expert_axis`, this runs inside shard_map with the
    experts split over that mesh axis (E per device, the router [E_total, D] replicated): each
    device routes all tokens, computes the assignments to its own experts and psums the result
    over the axis. If F is split as well (tensor parallel), the caller psums over that axis.
    `routes`: (experts_MA, weights_MA) as `route` gives them, where the caller routed the tokens
    itself (a kernel's routing, `kernels.route`); else this routes them.
    """
    B, T, D = x_BTD.shape
    E = experts_gate_up_EJFD.shape[0]
    x_MD = x_BTD.reshape(B * T, D)
    experts_MA, weights_MA = routes or route(x_MD, router_ED, experts_per_token, norm_topk_prob)
    local_MA = None
    if expert_axis is not None:
        experts_MA = experts_MA - jax.lax.axis_index(expert_axis) * E
        local_MA = (experts_MA >= 0) & (experts_MA < E)
    path = path or moe_path(B * T, experts_per_token, E, decode=T == 1)
    if path not in ("gather", "dense", "ragged"):
        raise ValueError(f"unknown MoE path {path!r}: 'gather', 'dense' or 'ragged'")
    if local_MA is not None:  # other devices' assignments: any valid id to gather, else one past E
        experts_MA = jnp.where(local_MA, experts_MA, 0 if path == "gather" else E)
    if path == "dense":
        out_MD = _experts_dense(x_MD, experts_MA, weights_MA, experts_gate_up_EJFD, experts_down_EDF)
    else:
        experts = _experts_gather if path == "gather" else _experts_ragged
        out_MAD = experts(x_MD, experts_MA, experts_gate_up_EJFD, experts_down_EDF).astype(jnp.float32)
        if local_MA is not None:  # other devices' assignments: select, not multiply (garbage may be inf)
            out_MAD = jnp.where(local_MA[:, :, None], out_MAD, 0.0)
        out_MD = jnp.einsum("MAD,MA->MD", out_MAD, weights_MA)
    if expert_axis is not None:
        out_MD = jax.lax.psum(out_MD, expert_axis)
    return out_MD.astype(x_BTD.dtype).reshape(B, T, D)
