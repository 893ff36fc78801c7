"""Mixture of experts as pure XLA forms: routing (softmax and top-k) and the three expert paths
(gather, dense, ragged/grouped GEMM), chosen statically from shapes (`moe_path`).

Two more letters for routed tokens: M = B*T tokens in one row, and R = M*A (token, expert)
assignments. Inside shard_map over an expert axis, E is the per-device expert count while the
router still scores all experts.
"""

import functools

import jax
import jax.numpy as jnp

from jaxllm.env import env_choice, env_flag
from jaxllm.layers.quant import QuantizedWeight
from jaxllm.runtime import fall_back, gpu_generation


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
      most experts once M*A > E), without a sort, permutations or a grouped-GEMM launch
      (docs/decisions/moe.md#three-paths-by-token-count).
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
    traffic (docs/decisions/moe.md#three-paths-by-token-count). int8 weights convert in the
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


# The gather path's gate and up sums as one variadic reduction, SwiGLU made on its sums: the same
# bits, faster for the experts (docs/decisions/moe.md#swiglu-in-the-experts-reduction).
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
    (ragged_dot_mgpu), several times faster in prefill (docs/decisions/moe.md#the-grouped-gemm-for-prefill)
    than XLA's ragged_dot, which XLA's GPU compiler (per its source) expands over all E groups;
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
    sites took 80 s to compile (about 1 s each). None, after one warning, where the kernel's
    module fails to import (a JAX without it): then `ragged_dot` is XLA's."""
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    except Exception as e:  # ImportError, or any error of a module changed or half removed
        reason = f"{type(e).__name__}: {e}".splitlines()[0]
        fall_back("grouped_gemm", f"the Pallas Mosaic GPU ragged_dot is unavailable ({reason})")
        return None
    return jax.jit(functools.partial(ragged_dot_mgpu.ragged_dot, **MGPU_TILES, transpose_rhs=True))


def _mgpu_ok(x_RK, w_ENK) -> bool:
    if GROUPED_GEMM != "auto" or isinstance(w_ENK, QuantizedWeight):
        return False
    E, N, K = w_ENK.shape
    return (gpu_generation() == 9 and x_RK.dtype == w_ENK.dtype
            and x_RK.dtype in (jnp.bfloat16, jnp.float16)
            and K % MGPU_TILES["block_k"] == 0 and N % MGPU_TILES["block_n"] == 0
            and _mgpu_ragged_dot() is not None)


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
