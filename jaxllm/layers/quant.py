"""int8 weight-only quantization: the `QuantizedWeight` leaf, `quantize` and `dequantize`.

The leaf knows nothing of `Params`; which of the model's matrices are quantized, and
`quantize_params`, live in model/params.py.

A quantized matrix keeps the layout of the weight it replaces (outputs first, contraction axes
minor; see params.py) as int8 `q` [O..., C], with one float32 scale per output channel [O...]:
w ~= q * scale[..., None], q = round(w / scale) in [-127, 127], scale = max|w over the row| / 127,
so each element is off by at most scale / 2. `layers.project` contracts against `q` and applies
the scale to the output (exact: the scale is constant along the contraction), so a decode step
reads one byte per weight instead of two. Activations, the KV cache, norms and biases keep the
model dtype, which the weight records as `dtype`.

Which matrices: every projection a step streams: wqkv, wo, w_gate_up, w_down, the MoE experts
and lm_head. The embedding table is quantized only when it is tied, because then it is the
lm_head, the largest single read of small models (SmolLM2-135M: 28M of its 135M weights); its
rows are looked up dequantized (one per-row scale serves both uses). An untied table is only
gathered (B*T rows per step), so quantizing it would save memory but no time: it stays as is, as
in gpt-fast's int8 mode. Router matrices (tiny, and routing is sensitive) stay as well.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import struct

QUANT_MODES = ("none", "int8")

@struct.dataclass
class QuantizedWeight:
    """int8 values and per-output-channel scales standing in for a float weight of `dtype`."""

    q: jax.Array  # int8 [O..., C...]
    scale: jax.Array  # float32 [O...]
    dtype: jnp.dtype = struct.field(pytree_node=False)  # the float weight's (the model's) dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape

    @property
    def ndim(self) -> int:
        return self.q.ndim

    def reshape(self, *shape) -> QuantizedWeight:
        """Reshape q, keeping the output channels leading (the scale takes the first axes of the new
        shape that hold as many entries): merging the contraction axes for `project`, say."""
        q = self.q.reshape(*shape)
        size, k = 1, 0
        while size < self.scale.size and k < q.ndim:
            size, k = size * q.shape[k], k + 1
        if size != self.scale.size:
            raise ValueError(f"reshape {self.q.shape} -> {q.shape} splits the {self.scale.shape} "
                             f"output channels of a quantized weight")
        return self.replace(q=q, scale=self.scale.reshape(q.shape[:k]))

    def __getitem__(self, index) -> jax.Array:
        """Rows along the leading (output) axes, dequantized to `dtype`: the embedding lookup of a
        tied table, the experts a token is routed to."""
        q, scale = self.q[index], self.scale[index]
        extra = q.ndim - scale.ndim
        return (q.astype(jnp.float32) * scale.reshape(scale.shape + (1,) * extra)).astype(self.dtype)


def quantize(w: jax.Array, contract_axes: int = 1, dtype=None) -> QuantizedWeight:
    """Symmetric int8 with one scale per output channel (absmax over the last `contract_axes`).

    An all-zero channel gets scale 0 and q 0. `dtype` (default w's) is what the weight stands in for.
    """
    axes = tuple(range(w.ndim - contract_axes, w.ndim))
    return _quantize(w, axes, jnp.dtype(dtype or w.dtype))


@partial(jax.jit, static_argnums=(1, 2))
def _quantize(w, axes, dtype):
    w32 = w.astype(jnp.float32)
    scale = jnp.max(jnp.abs(w32), axis=axes) / 127.0
    safe = jnp.where(scale > 0, scale, 1.0).reshape(scale.shape + (1,) * len(axes))
    q = jnp.clip(jnp.round(w32 / safe), -127, 127).astype(jnp.int8)
    return QuantizedWeight(q=q, scale=scale, dtype=dtype)


def dequantize(w: QuantizedWeight) -> jax.Array:
    """The float weight (of w.dtype) that the int8 values and scales represent."""
    return w[...]


def stored(w):
    """The array holding w's streamed bytes: a `QuantizedWeight`'s int8 values (its scales are
    few), any other weight itself."""
    return w.q if isinstance(w, QuantizedWeight) else w


def weight_leaves(tree) -> list:
    """tree's leaves, each `QuantizedWeight` one leaf rather than its values and scales."""
    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, QuantizedWeight))
