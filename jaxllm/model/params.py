"""Parameter pytrees and the one table that declares every parameter.

`layer_specs` / `top_specs` declare each parameter once: its shape, logical axes (for sharding),
how it is initialised, and the source tensors it is converted from, by role ("layers.3.q";
jaxllm.families names the HF tensor of each role per family). Random init,
abstract shapes, shardings and checkpoint conversion are all derived from that table.

Layout, converted once at load time so the decode step needs no transposes. Every matrix keeps
its contraction axes last (minor), as in a HF [out, in] Linear: at batch 1 each output is a
contiguous dot product, which XLA's GEMV kernels stream near HBM bandwidth; with the contraction
axis major they streamed about half as fast (docs/decisions/loop-and-compiler.md#weight-layout).
  wqkv [K, G+2, H, D]: per KV head, its G query heads, then its key head, then its value head,
                       so a tensor-parallel split over K is one contiguous slice of whole groups.
  wo   [D, K, G, H],  w_gate_up [2, F, D],  w_down [D, F],  lm_head [V, D] (absent when tied).
  MoE: router [E, D], experts_gate_up [E, 2, F, D], experts_down [E, D, F]: each expert is one
       contiguous block in HF's per-expert [out, in] layout, so gathering or splitting experts
       moves whole contiguous matrices.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxllm.layers.quant import QUANT_MODES, QuantizedWeight, quantize, weight_leaves
from jaxllm.model.config import ModelConfig


@struct.dataclass
class Layer:
    """One decoder block. Fields a family lacks are None."""

    attn_norm: jax.Array  # [D]
    wqkv: jax.Array  # [K, G+2, H, D]
    wo: jax.Array  # [D, K, G, H]
    mlp_norm: jax.Array  # [D]
    w_gate_up: jax.Array | None = None  # [2, F, D] dense MLP
    w_down: jax.Array | None = None  # [D, F]
    bqkv: jax.Array | None = None  # [K, G+2, H] (Qwen2, Llama attention_bias)
    bo: jax.Array | None = None  # [D]
    q_norm: jax.Array | None = None  # [H] (Qwen3, Gemma 3)
    k_norm: jax.Array | None = None  # [H]
    post_attn_norm: jax.Array | None = None  # [D] (Gemma: the attention's output, normed)
    post_mlp_norm: jax.Array | None = None  # [D] (Gemma: the MLP's output, normed)
    router: jax.Array | None = None  # [E, D] (MoE)
    experts_gate_up: jax.Array | None = None  # [E, 2, F, D]
    experts_down: jax.Array | None = None  # [E, D, F]


@struct.dataclass
class Params:
    """All weights of a model; `config` rides along as static metadata."""

    embed: jax.Array  # [V, D]
    layers: list[Layer]
    final_norm: jax.Array  # [D]
    lm_head: jax.Array | None  # [V, D]; None when tied to embed
    config: ModelConfig = struct.field(pytree_node=False)
    # None on one device; a `jaxllm.model.sharding.TensorParallel` (mesh and split axes) when sharded.
    tp: Any = struct.field(pytree_node=False, default=None)

    @property
    def dtype(self):
        return self.embed.dtype


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter: shape, logical axes, init, and its source tensors by role."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # logical axis names: "vocab", "heads_kv", "ffn", "experts"
    init: str  # "normal" | "ones" | "zeros"
    # (role key, shape) of each source tensor: "embed", "layers.{i}.q", "layers.{i}.experts.{e}.up"
    sources: tuple[tuple[str, tuple[int, ...]], ...]
    # The parameter's array -> one view of it per source tensor (in sources order), where that
    # tensor's values land in C order: loading reads each source straight into its view.
    parts: Callable[[np.ndarray], tuple[np.ndarray, ...]]


def _whole(out: np.ndarray) -> tuple[np.ndarray]:
    return (out,)


def _leading(out: np.ndarray) -> tuple[np.ndarray, ...]:
    return tuple(out)


def layer_specs(cfg: ModelConfig, i: int) -> dict[str, ParamSpec]:
    """The parameters of layer i (MoE layers and family switches change the set)."""
    K, G, H, D = cfg.num_kv_heads, cfg.q_per_kv, cfg.head_dim, cfg.hidden_size
    N, F = cfg.num_heads, cfg.ffn_size
    p = f"layers.{i}."
    norm = _norm_init(cfg)

    def qkv_parts(out):  # [K, G+2, H, (D)]: q [N*H, (D)] as [K, G, H], then k and v [K*H, (D)]
        return out[:, :G], out[:, G:G + 1], out[:, G + 1:]
    specs = {
        "attn_norm": ParamSpec((D,), (None,), norm, ((p + "attn_norm", (D,)),), _whole),
        "wqkv": ParamSpec(
            (K, G + 2, H, D), ("heads_kv", None, None, None), "normal",
            ((p + "q", (N * H, D)), (p + "k", (K * H, D)), (p + "v", (K * H, D))), qkv_parts),
        "wo": ParamSpec((D, K, G, H), (None, "heads_kv", None, None), "normal",
                        ((p + "o", (D, N * H)),),
                        _whole),
        "mlp_norm": ParamSpec((D,), (None,), norm,
                              ((p + "mlp_norm", (D,)),), _whole),
    }
    if cfg.qkv_bias:
        specs["bqkv"] = ParamSpec(
            (K, G + 2, H), ("heads_kv", None, None), "zeros",
            ((p + "q_bias", (N * H,)), (p + "k_bias", (K * H,)), (p + "v_bias", (K * H,))), qkv_parts)
    if cfg.o_bias:
        specs["bo"] = ParamSpec((D,), (None,), "zeros", ((p + "o_bias", (D,)),), _whole)
    if cfg.qk_norm:
        specs["q_norm"] = ParamSpec((H,), (None,), norm, ((p + "q_norm", (H,)),), _whole)
        specs["k_norm"] = ParamSpec((H,), (None,), norm, ((p + "k_norm", (H,)),), _whole)
    if cfg.post_norms:
        for name in ("post_attn_norm", "post_mlp_norm"):
            specs[name] = ParamSpec((D,), (None,), norm, ((p + name, (D,)),), _whole)
    if cfg.is_moe(i):
        specs.update(moe_specs(cfg, i))
    else:
        specs["w_gate_up"] = ParamSpec(
            (2, F, D), (None, "ffn", None), "normal",
            ((p + "gate", (F, D)), (p + "up", (F, D))),
            _leading)
        specs["w_down"] = ParamSpec((D, F), (None, "ffn"), "normal",
                                    ((p + "down", (D, F)),), _whole)
    return specs


def moe_specs(cfg: ModelConfig, i: int) -> dict[str, ParamSpec]:
    """Router and stacked experts of a sparse layer, from per-expert source tensors."""
    D, E, F = cfg.hidden_size, cfg.num_experts, cfg.moe_ffn_size
    router = f"layers.{i}.router"
    gate, up, down = (f"layers.{i}.experts.{{e}}.{w}" for w in ("gate", "up", "down"))
    gate_up_sources = tuple((n.format(e=e), (F, D)) for e in range(E) for n in (gate, up))
    return {
        "router": ParamSpec((E, D), (None, None), "normal", ((router, (E, D)),), _whole),
        "experts_gate_up": ParamSpec(  # sources alternate gate, up per expert
            (E, 2, F, D), ("experts", None, "ffn", None), "normal", gate_up_sources,
            lambda out: tuple(out.reshape(2 * E, F, D))),
        "experts_down": ParamSpec(
            (E, D, F), ("experts", None, "ffn"), "normal",
            tuple((down.format(e=e), (D, F)) for e in range(E)), _leading),
    }


def _norm_init(cfg: ModelConfig) -> str:
    """A norm weight's neutral value: ones, or zeros where the norm scales by (1 + w) (Gemma)."""
    return "zeros" if cfg.norm_offset else "ones"


def top_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    V, D = cfg.vocab_size, cfg.hidden_size
    specs = {
        "embed": ParamSpec((V, D), ("vocab", None), "normal", (("embed", (V, D)),),
                           _whole),
        "final_norm": ParamSpec((D,), (None,), _norm_init(cfg), (("final_norm", (D,)),), _whole),
    }
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((V, D), ("vocab", None), "normal", (("lm_head", (V, D)),),
                                     _whole)
    return specs


def _assemble(cfg: ModelConfig, make: Callable[[str, ParamSpec], Any]) -> Params:
    """Build a Params by calling make(path, spec) for every declared parameter."""
    layers = [Layer(**{name: make(f"layers.{i}.{name}", s) for name, s in layer_specs(cfg, i).items()})
              for i in range(cfg.num_layers)]
    top = {name: make(name, s) for name, s in top_specs(cfg).items()}
    return Params(embed=top["embed"], layers=layers, final_norm=top["final_norm"],
                  lm_head=top.get("lm_head"), config=cfg)


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.bfloat16, scale: float = 0.02, *,
                sharding_of: Callable[[str], Any] | None = None) -> Params:
    """Random weights of the config's shapes (benchmarks, tests): normal(0, scale) matrices.

    `sharding_of(path)`: the sharding of each parameter (see `sharding.init_sharded`); each is
    then drawn straight into its shards by a program of its own, with the same values.
    """
    counter = iter(range(1 << 30))

    def make(path, s: ParamSpec):
        key_i = jax.random.fold_in(key, next(counter)) if s.init == "normal" else None
        if sharding_of is None:
            return _init_tensor(s.init, s.shape, dtype, key_i, scale)
        return _init_jit(s.init, s.shape, jnp.dtype(dtype), sharding_of(path))(key_i, scale)
    return _assemble(cfg, make)


def _init_tensor(init: str, shape, dtype, key, scale: float):
    if init == "ones":
        return jnp.ones(shape, dtype)
    if init == "zeros":
        return jnp.zeros(shape, dtype)
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


@functools.cache
def _init_jit(init: str, shape, dtype, out_sharding):
    return jax.jit(functools.partial(_init_tensor, init, shape, dtype), out_shardings=out_sharding)


def abstract_params(cfg: ModelConfig, dtype=jnp.bfloat16) -> Params:
    """ShapeDtypeStructs of every parameter, without allocating (memory planning, eval_shape)."""
    return _assemble(cfg, lambda path, s: jax.ShapeDtypeStruct(s.shape, dtype))


def logical_axes(cfg: ModelConfig) -> Params:
    """The same pytree with each leaf replaced by its tuple of logical axis names."""
    return _assemble(cfg, lambda path, s: _Axes(s.axes))


@dataclasses.dataclass(frozen=True)
class _Axes:
    """A leaf wrapper so tuples of axis names are not flattened as pytrees."""

    names: tuple[str | None, ...]


def param_count(params: Params) -> int:
    """Weights of the model; an int8 matrix counts its values, not its per-channel scales."""
    return sum(int(np.prod(x.shape)) for x in weight_leaves(params))


def require_params(params) -> Params:
    """`params` where it is a model's Params, else a TypeError saying what it is (a path, say)."""
    if not isinstance(params, Params):
        raise TypeError(f"params must be a model's Params, as jaxllm.load returns them, got "
                        f"{type(params).__name__} {params!r:.80}")
    return params


def leaf_paths(params) -> list[str]:
    """The `_assemble` path of each leaf of a Params tree, in leaf order ("layers.3.wqkv",
    "embed")."""
    return [".".join(str(getattr(k, "name", getattr(k, "idx", k))) for k in path)
            for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


def param_bytes(params: Params) -> int:
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))


def named_specs(cfg: ModelConfig) -> list[tuple[str, ParamSpec]]:
    """Every parameter's (path, spec), paths as `_assemble` names them ("layers.3.wqkv",
    "embed"), in the order it makes them (a checkpoint's order of tensors)."""
    return ([(f"layers.{i}.{n}", s) for i in range(cfg.num_layers) for n, s in layer_specs(cfg, i).items()]
            + list(top_specs(cfg).items()))


# The quantized Layer fields and how many trailing axes each contracts (wo [D, K, G, H]: all of
# K, G, H, one scale per D; the others keep only their last axis minor).
LAYER_WEIGHTS = {"wqkv": 1, "wo": 3, "w_gate_up": 1, "w_down": 1, "experts_gate_up": 1,
                 "experts_down": 1}



def quantize_leaf(name: str, w, tied: bool, dtype=None):
    """Quantize parameter `name` (a Params path such as "layers.3.wqkv", "lm_head", "embed") when
    it is one of the quantized matrices; anything else comes back unchanged."""
    field = name.rsplit(".", 1)[-1]
    if field in LAYER_WEIGHTS and name.startswith("layers."):
        return quantize(w, LAYER_WEIGHTS[field], dtype)
    if field == "lm_head" or (field == "embed" and tied):
        return quantize(w, 1, dtype)
    return w


def quantizing_place(dtype, tied: bool):
    """A `reading.from_hf_tensors` place function: each matrix to quantize goes to the device as it
    comes (float32 at most) and is quantized there, the rest is cast to `dtype`. The device holds
    the quantized model plus one float tensor at a time, never the whole float model."""
    dtype = jnp.dtype(dtype)

    def place(path: str, x):
        w = quantize_leaf(path, jnp.asarray(x), tied, dtype)
        return w if isinstance(w, QuantizedWeight) else jnp.asarray(w, dtype)
    return place


def is_quantized(params: Params) -> bool:
    """Whether any of params' matrices is a `QuantizedWeight`."""
    return any(isinstance(x, QuantizedWeight) for x in weight_leaves(params))


def quantize_params(params: Params, mode: str = "int8") -> Params:
    """Params with the big matrices as int8 `QuantizedWeight`s (mode "none": unchanged)."""
    if mode not in QUANT_MODES:
        raise ValueError(f"unknown quantization {mode!r}; choose one of {', '.join(QUANT_MODES)}")
    if mode == "none":
        return params
    if params.tp is not None:
        raise ValueError("int8 quantization of tensor-parallel (sharded) params is not implemented yet")
    if is_quantized(params):
        raise ValueError("these params are quantized already")
    dtype, tied = params.dtype, params.lm_head is None

    def quantize_layer(i, layer):
        return layer.replace(**{f: quantize_leaf(f"layers.{i}.{f}", getattr(layer, f), tied, dtype)
                                for f in LAYER_WEIGHTS if getattr(layer, f) is not None})
    return params.replace(
        layers=[quantize_layer(i, layer) for i, layer in enumerate(params.layers)],
        embed=quantize_leaf("embed", params.embed, tied, dtype),
        lm_head=None if tied else quantize_leaf("lm_head", params.lm_head, tied, dtype))
