"""A MoE layer's routing in one kernel a token: the softmax over the router's logits and the top A
experts with their weights, as `layers.moe.route` computes them, where XLA ran a softmax kernel and
a sort (docs/decisions/moe.md#routing-as-one-kernel)."""

import functools

import jax
import jax.numpy as jnp

from jaxllm import runtime
from jaxllm.kernels.common import pl, plt, launch_dependents, pdl_trigger, pow2
from jaxllm.kernels.tuning import KernelTuning, current
from jaxllm.layers import moe as moe_layers


def supports(num_experts: int, experts_per_token: int) -> bool:
    """The kernel's hard limits: 1 to num_experts experts a token (its one program holds all E)."""
    return 1 <= experts_per_token <= num_experts


def route(x_MD, router_ED, experts_per_token: int, norm_topk_prob: bool, *,
          mode: str | None = None, tuning: KernelTuning | None = None):
    """(experts_MA int32, weights_MA float32) as `layers.route` gives them; with `mode` the
    router's logits from XLA's product, then `layers.moe.pick_experts` in one kernel a token."""
    if mode is None:
        return moe_layers.route(x_MD, router_ED, experts_per_token, norm_topk_prob)
    return pick_experts(moe_layers.router_logits(x_MD, router_ED), experts_per_token, norm_topk_prob,
                        interpret=mode == "interpret", tuning=tuning or current())


@functools.partial(jax.jit, static_argnames=("experts_per_token", "norm_topk_prob", "interpret",
                                             "tuning"))
def pick_experts(logits_ME, experts_per_token: int, norm_topk_prob: bool, *,
                 interpret: bool = False, tuning: KernelTuning | None = None):
    """`layers.moe.pick_experts` in one kernel a token."""
    M, E = logits_ME.shape
    A = experts_per_token
    trigger = pdl_trigger(interpret, tuning or current()) and M <= runtime.multiprocessors()
    out = pl.BlockSpec((1, A), lambda m: (m, 0))
    return pl.pallas_call(
        functools.partial(_route_kernel, E=E, A=A, P=pow2(E), Q=pow2(A), norm=norm_topk_prob,
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
        cols = cols & (launch_dependents(pl.program_id(0)) >= 0)
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
