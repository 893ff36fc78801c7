"""Tensor parallelism: which axes split over the mesh axis "tp", and how params get there.

A sharded `Params` carries a `TensorParallel` as static metadata (`params.tp`): the mesh and
which logical axes of the parameter table (`params.logical_axes`) are split. `model.step` and
`model.forward` see it and run their per-device function under `jax.shard_map`, where N, K, F, V
and E are per-device counts and the partial sums meet in a `psum` after the attention output
projection, after the down projection (or the experts) and after the embedding lookup. Logits
leave `shard_map` split over the vocabulary, and sampling runs on them as on any sharded array:
XLA partitions greedy's argmax into a per-device max/argmax and an all-gather of [B, tp] pairs
(never the [B, V] logits; tests/test_sharding.py checks the compiled program); the top-k/top-p
sort gathers them.

Splits, each taken only where the size divides evenly (otherwise that tensor stays whole on every
device, which is correct and only costs memory):
  heads_kv   wqkv [K, G+2, H, D], wo [D, K, G, H], bqkv and the KV cache [B, K, S, H]: whole
             groups of a KV head and its G query heads per device. With fewer KV heads than
             devices, each KV head is repeated r times at load (`kv_replicas`), each copy serving
             G/r of its query heads; the layout config then says K*r KV heads and G/r per group.
             This is the same function: the query heads keep their order, only k and v repeat.
  ffn        w_gate_up [2, F, D], w_down [D, F].
  vocab      embed [V, D], lm_head [V, D].
  experts    MoE: either the experts split (expert parallel: `layers.moe(expert_axis=...)`), or
             each expert's F (tensor parallel, the default: at batch 1 it spreads the chosen
             experts' bytes over every device instead of leaving most devices idle).
A mesh may also have a "data" axis: the batch splits over it and the params are replicated.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxllm.model.cache import KVCache
from jaxllm.model.config import ModelConfig
from jaxllm.model.params import Params, _Axes, abstract_params, init_params, logical_axes, named_specs

TP = "tp"
DATA = "data"


def make_mesh(tp: int, data: int = 1, devices=None) -> Mesh:
    """A mesh of tp (x data) devices, axes ("tp",) or ("data", "tp"); the first devices by default.

    The one-line hook for a CLI `--tp N`: `mesh = make_mesh(N) if N > 1 else None`.
    """
    devices = list(jax.devices() if devices is None else devices)
    if not all(isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in (tp, data)):
        raise TypeError(f"mesh sizes must be whole numbers, got tp={tp!r} data={data!r}")
    if tp < 1 or data < 1:
        raise ValueError(f"mesh sizes must be >= 1, got tp={tp} data={data}")
    if not devices:
        raise ValueError("a mesh needs devices; the list given is empty")
    if tp * data > len(devices):
        raise ValueError(f"a mesh of tp={tp} x data={data} needs {tp * data} devices; "
                         f"{len(devices)} are visible ({devices[0].platform})")
    shape, names = ((data, tp), (DATA, TP)) if data > 1 else ((tp,), (TP,))
    # Auto axes: outside shard_map, XLA propagates the shardings (of the sampled logits, the cache).
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names),
                         devices=devices[:tp * data])


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """How a Params is split over `mesh`'s "tp" axis (hashable: static metadata of Params)."""

    mesh: Mesh
    heads: bool  # wqkv/wo/bqkv and the KV cache split by KV head
    ffn: bool  # dense w_gate_up/w_down split by F
    vocab: bool  # embed/lm_head split by V
    experts: bool  # MoE experts split (expert parallel)
    expert_ffn: bool  # each expert's F split (tensor parallel)
    kv_replicas: int = 1  # each checkpoint KV head appears this many times (already in the config)

    @property
    def size(self) -> int:
        return self.mesh.shape[TP]

    @property
    def batch_axis(self) -> str | None:
        return DATA if DATA in self.mesh.axis_names else None


def _check_mesh(mesh: Mesh):
    if TP not in mesh.axis_names:
        raise ValueError(f"the mesh needs an axis named {TP!r}; it has {mesh.axis_names}")
    extra = set(mesh.axis_names) - {TP, DATA}
    if extra:
        raise ValueError(f"unknown mesh axes {sorted(extra)}: jaxllm shards over {TP!r} and {DATA!r}")


def kv_replicas(cfg: ModelConfig, tp: int) -> int:
    """How often to repeat each KV head so the K heads split evenly over tp devices (1: no need).

    The repeated heads number lcm(K, tp); each copy must serve a whole number of query heads. When
    that fails (e.g. K 3, G 3 on 2 devices) it returns 1 and `plan` keeps attention unsplit.
    """
    K, G = cfg.num_kv_heads, cfg.q_per_kv
    r = math.lcm(K, tp) // K
    return r if G % r == 0 else 1


def plan(cfg: ModelConfig, mesh: Mesh, expert_parallel: bool = False) -> tuple[ModelConfig, TensorParallel]:
    """(layout config, TensorParallel) for a checkpoint config on `mesh`.

    The layout config differs from `cfg` only by the repeated KV heads (`kv_replicas`).
    """
    _check_mesh(mesh)
    tp = mesh.shape[TP]
    r = kv_replicas(cfg, tp)
    layout = cfg if r == 1 else dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * r)
    experts = expert_parallel and cfg.num_experts > 0 and cfg.num_experts % tp == 0
    if expert_parallel and cfg.num_experts and not experts:
        raise ValueError(f"expert parallelism needs the {cfg.num_experts} experts to divide evenly "
                         f"over tp={tp} devices")
    return layout, TensorParallel(
        mesh=mesh, heads=layout.num_kv_heads % tp == 0, ffn=cfg.ffn_size % tp == 0,
        vocab=cfg.vocab_size % tp == 0, experts=experts,
        expert_ffn=cfg.num_experts > 0 and not experts and cfg.moe_ffn_size % tp == 0,
        kv_replicas=r)


def _spec(tp: TensorParallel, axes: tuple[str | None, ...]) -> P:
    """The PartitionSpec of one parameter from its logical axis names."""
    split = {"heads_kv": tp.heads, "vocab": tp.vocab, "experts": tp.experts,
             "ffn": tp.expert_ffn if "experts" in axes else tp.ffn}
    return P(*(TP if name is not None and split[name] else None for name in axes))


def _axes_by_path(cfg: ModelConfig) -> dict[str, tuple[str | None, ...]]:
    """Logical axes by the parameter paths of `params._assemble` ("layers.3.wqkv", "embed")."""
    return {path: s.axes for path, s in named_specs(cfg)}


def param_specs(cfg: ModelConfig, tp: TensorParallel) -> Params:
    """A Params of PartitionSpecs (the shard_map in_specs; the same static metadata as the params)."""
    axes = logical_axes(cfg)
    return jax.tree.map(lambda a: _spec(tp, a.names), axes,
                        is_leaf=lambda x: isinstance(x, _Axes)).replace(tp=tp)


def param_shardings(cfg: ModelConfig, tp: TensorParallel) -> Params:
    return jax.tree.map(lambda s: NamedSharding(tp.mesh, s), param_specs(cfg, tp),
                        is_leaf=lambda x: isinstance(x, P))


def cache_specs(tp: TensorParallel, num_layers: int) -> KVCache:
    """KV cache [B, K, S, H] split by KV head (and by row over a "data" axis)."""
    kv = P(tp.batch_axis, TP if tp.heads else None)
    return KVCache(k=[kv] * num_layers, v=[kv] * num_layers, start=P(tp.batch_axis),
                   end=P(tp.batch_axis))


def logits_spec(tp: TensorParallel, ndim: int) -> P:
    """[B, (T,) V] logits: rows over "data", the vocabulary over "tp" when it is split."""
    return P(tp.batch_axis, *([None] * (ndim - 2)), TP if tp.vocab else None)


def shard_call(fn: Callable, params: Params, tokens_BT, cache: KVCache, *, logits_ndim: int):
    """fn(params, tokens, cache, axis) -> (logits, cache), run per device under shard_map.

    Inside fn every array is the device's own slice; the result is the global (logits, cache).
    """
    tp = params.tp
    if tp.batch_axis is not None and tokens_BT.shape[0] % tp.mesh.shape[DATA]:
        raise ValueError(f"a batch of {tokens_BT.shape[0]} rows does not split over the mesh's "
                         f"data axis of {tp.mesh.shape[DATA]}")
    specs = cache_specs(tp, len(cache.k))
    # check_vma off: the Pallas kernels' outputs (decode attention on a GPU) declare no
    # varying mesh axes, which the check would demand of them.
    local = jax.shard_map(lambda p, t, c: fn(p, t, c, TP), mesh=tp.mesh,
                          in_specs=(param_specs(params.config, tp), P(tp.batch_axis), specs),
                          out_specs=(logits_spec(tp, logits_ndim), specs), check_vma=False)
    return local(params, tokens_BT, cache)


# --- Putting params on the mesh -----------------------------------------------------------------


def to_layout(name: str, x, cfg: ModelConfig, r: int):
    """One parameter (named as in `Layer`) in the layout with each KV head repeated r times.

    The N query heads keep their order (head n = (k*r + j)*G/r + g), so wo only reshapes; the key
    and value heads repeat. Works on numpy and jax arrays alike.
    """
    if r == 1 or name not in ("wqkv", "bqkv", "wo"):
        return x
    K, G = cfg.num_kv_heads, cfg.q_per_kv
    xp = jnp if isinstance(x, jax.Array) else np
    if name == "wo":  # [D, K, G, H] -> [D, K*r, G/r, H]
        return x.reshape(x.shape[0], K * r, G // r, *x.shape[3:])
    # [K, G+2, H, (D)] -> [K*r, G/r+2, H, (D)]
    tail = x.shape[2:]
    q = x[:, :G].reshape(K * r, G // r, *tail)
    kv = xp.repeat(x[:, G:], r, axis=0)
    return xp.concatenate([q, kv], axis=1)


def _leaf_name(path) -> str:
    return str(getattr(path[-1], "name", getattr(path[-1], "key", path[-1])))


def shard_params(params: Params, mesh: Mesh, *, expert_parallel: bool = False) -> Params:
    """Unsharded params onto `mesh`, one parameter at a time (tests, random-weight benchmarks)."""
    if params.tp is not None:
        raise ValueError("these params are sharded already")
    layout, tp = plan(params.config, mesh, expert_parallel)
    shardings = param_shardings(layout, tp)
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    placed = [jax.device_put(to_layout(_leaf_name(path), x, params.config, tp.kv_replicas), s)
              for (path, x), s in zip(leaves, jax.tree.leaves(shardings))]
    return jax.tree.unflatten(jax.tree.structure(shardings), placed)


def abstract_sharded(cfg: ModelConfig, mesh: Mesh, dtype=jnp.bfloat16, *,
                     expert_parallel: bool = False) -> Params:
    """ShapeDtypeStructs with their shardings (memory planning, `jax.eval_shape`, AOT lowering)."""
    layout, tp = plan(cfg, mesh, expert_parallel)
    shapes = abstract_params(layout, dtype)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, param_shardings(layout, tp).replace(tp=None)).replace(tp=tp)


def init_sharded(cfg: ModelConfig, key: jax.Array, mesh: Mesh, dtype=jnp.bfloat16, *,
                 expert_parallel: bool = False, scale: float = 0.02) -> Params:
    """Random weights drawn straight into their shards (no device holds the whole model): the
    values `init_params` draws for the sharded layout, one tensor at a time, an order of magnitude
    faster than one program drawing the whole model
    (docs/decisions/tensor-parallel.md#random-weights-drawn-into-their-shards)."""
    layout, tp = plan(cfg, mesh, expert_parallel)
    axes = _axes_by_path(layout)
    return init_params(layout, key, dtype, scale,
                       sharding_of=lambda path: NamedSharding(mesh, _spec(tp, axes[path]))).replace(tp=tp)


def per_device_bytes(params: Params) -> int:
    """Bytes of parameters on the device holding the most (arrays or sharded ShapeDtypeStructs)."""
    total: dict[Any, int] = {}
    for x in jax.tree.leaves(params):
        shard = x.sharding.shard_shape(x.shape)
        for d in x.sharding.device_set:
            total[d] = total.get(d, 0) + int(np.prod(shard)) * jnp.dtype(x.dtype).itemsize
    return max(total.values())
