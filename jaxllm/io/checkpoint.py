"""Converted params as an orbax checkpoint: convert once, then restore onto any mesh.

A checkpoint directory holds `jaxllm_config.json` (the ModelConfig) and `params/` (orbax, one
tensorstore array per parameter, in the checkpoint layout: the config's own KV heads, never the
repeated heads of a sharded layout). `restore` reads each device's slice straight from disk:
every parameter is restored with its target sharding, so no device and no host holds a whole
tensor. Repeating KV heads is the exception: with one copy per device (tp = K * r) each device
reads its whole KV group of wqkv/bqkv and keeps its part; otherwise (e.g. K 6 on 4 devices)
each device reads every layer's wqkv, bqkv and wo whole, then keeps its slice.
`jaxllm.load(directory, mesh=...)` calls `restore`.

Beside the config, jaxllm_config.json holds a digest of each array's bits (`digest`), made on the
devices as it is saved and checked on them as it is restored: orbax finds a truncated file, but
bytes changed inside a data file (only some of which zstd notices) would otherwise load as
different weights. Each array is read in the dtype it was saved in, checked, then cast (a part
of the model at a time, where it is cast).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxllm.io import paths
from jaxllm.layers.quant import QuantizedWeight
from jaxllm.model import sharding
from jaxllm.model.config import ModelConfig, RopeConfig, read_json_object
from jaxllm.model.params import (Params, abstract_params, is_quantized, layer_specs, leaf_paths,
                                 quantize_params, top_specs)

CONFIG_FILE = "jaxllm_config.json"
FORMAT = 2  # 2: with the arrays' digests


def is_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / CONFIG_FILE).is_file()


def _config_to_json(cfg: ModelConfig) -> dict:
    return {"format": FORMAT, "config": dataclasses.asdict(cfg)}


def read_config(directory: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of a converted checkpoint, from its jaxllm_config.json (every key checked)."""
    config_file = Path(directory) / CONFIG_FILE
    meta = read_json_object(config_file)
    try:
        return _config_from_json(meta)
    except ValueError as e:
        raise ValueError(f"{config_file}: {e}") from None


def _config_from_json(d: dict) -> ModelConfig:
    """The ModelConfig of a jaxllm_config.json, every key checked by name."""
    if d.get("format") != FORMAT:
        raise ValueError(f"checkpoint format {d.get('format')!r} is not {FORMAT}: convert it again")
    c = _fields(d.get("config"), ModelConfig, "config")
    c["rope"] = RopeConfig(**_fields(c["rope"], RopeConfig, "config.rope"))
    if c["local_rope"] is not None:
        c["local_rope"] = RopeConfig(**_fields(c["local_rope"], RopeConfig, "config.local_rope"))
    for key in ("sliding_layers", "moe_layers", "eos_token_ids"):
        if isinstance(c[key], list):  # anything else ModelConfig refuses by name
            c[key] = tuple(c[key])
    return ModelConfig(**c)


# ModelConfig fields newer than FORMAT 2's first checkpoints (Gemma's): absent, they take their
# default, so that a model converted before them still loads.
_ADDED_FIELDS = ("local_rope", "norm_offset", "activation", "post_norms", "embed_scale",
                 "query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap")


def _fields(d, cls, where: str) -> dict:
    """`d` as the keyword arguments of dataclass `cls`: an object with exactly its fields."""
    if not isinstance(d, dict):
        raise ValueError(f"{where} must be an object, not {d!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if cls is ModelConfig:
        d = {**{name: fields[name].default for name in _ADDED_FIELDS}, **d}
    names = set(fields)
    missing, extra = sorted(names - d.keys()), sorted(d.keys() - names)
    if missing or extra:
        raise ValueError(f"{where} lacks keys {missing} / has unknown keys {extra}: convert it again")
    return dict(d)


def _to_tree(params: Params) -> dict:
    """Params as nested dicts of arrays (orbax's native form), None fields left out; an int8
    `QuantizedWeight` becomes {"q", "scale"}."""
    def leaf(x):
        return {"q": x.q, "scale": x.scale} if isinstance(x, QuantizedWeight) else x

    def fields(obj):
        return {f.name: leaf(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if f.name not in ("config", "tp") and getattr(obj, f.name) is not None}
    tree = fields(params)
    tree["layers"] = {str(i): fields(layer) for i, layer in enumerate(params.layers)}
    return tree


def _from_tree(tree: dict, template: Params) -> Params:
    def fill(obj, values: dict):
        def leaf(name, x):
            old = getattr(obj, name)
            return old.replace(q=x["q"], scale=x["scale"]) if isinstance(old, QuantizedWeight) else x
        return dataclasses.replace(obj, **{k: leaf(k, v) for k, v in values.items()})
    layers = [fill(layer, tree["layers"][str(i)]) for i, layer in enumerate(template.layers)]
    return fill(template.replace(layers=layers), {k: v for k, v in tree.items() if k != "layers"})


@jax.jit
def digest(x: jax.Array) -> jax.Array:
    """A uint32: the sum of x's bits (as unsigned integers of its width), each element weighted by
    a product of odd numbers, one made from its index along each axis. Changing any one element
    changes the sum (an odd factor cannot map a nonzero change to 0 modulo 2**32), and it wraps
    modulo 2**32, so any order of adding up, on any device or mesh, gives the same digest. One
    pass over the bytes: a second, independent sum would double the time on a CPU."""
    bits = lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}")).astype(jnp.uint32)
    weight = jnp.ones((), jnp.uint32)
    for axis, n in enumerate(x.shape):
        i = jnp.arange(n, dtype=jnp.uint32) + jnp.uint32(axis * 0x632BE5AB % 2**32)
        odd = (i * jnp.uint32(0x9E3779B1)) ^ (i >> 13) | jnp.uint32(1)
        weight = weight * odd.reshape([n if a == axis else 1 for a in range(x.ndim)])
    return jnp.sum(bits * weight, dtype=jnp.uint32)


def _named_leaves(tree: dict) -> list[tuple[str, jax.Array]]:
    """(path, array) of each leaf of a nested dict: "layers.3.wqkv", "layers.3.wqkv.q", "embed"."""
    return [(".".join(k.key for k in path), x) for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _digests(tree: dict) -> dict[str, str]:
    """Each array's `digest` as 8 hex digits, by path."""
    named = _named_leaves(tree)
    sums = jax.device_get([digest(x) for _, x in named])  # dispatched all, then fetched at once
    return {name: f"{int(v):08x}" for (name, _), v in zip(named, sums)}


def save(params: Params, directory: str | os.PathLike) -> Path:
    """Write params (on one device or sharded, without repeated KV heads) as a checkpoint."""
    import orbax.checkpoint as ocp

    if params.tp is not None and params.tp.kv_replicas > 1:
        raise ValueError("these params repeat KV heads for their mesh; save them from a mesh whose "
                         "tp size divides the KV heads (or from one device)")
    directory = Path(directory).absolute()
    paths.make_empty_dir(directory)
    tree = _to_tree(params)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(directory / "params", tree)
    digests = _digests(tree)  # every process takes part; process 0 writes them
    if jax.process_index() == 0:
        meta = _config_to_json(params.config) | {"digests": digests}
        if is_quantized(params):  # int8 values and float32 scales on disk: half the bytes
            meta["quant"], meta["dtype"] = "int8", jnp.dtype(params.dtype).name
        (directory / CONFIG_FILE).write_text(json.dumps(meta, indent=1))
    return directory


def restore(directory: str | os.PathLike, *, dtype=None, mesh: Mesh | None = None,
            expert_parallel: bool = False) -> Params:
    """Params from a checkpoint: on the default device, or sharded onto `mesh`, cast to `dtype`."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    config_file = directory / CONFIG_FILE
    meta_json = read_json_object(config_file)
    try:
        cfg = _config_from_json(meta_json)
        quant, saved_dtype = meta_json.get("quant"), meta_json.get("dtype")
        if quant not in (None, "int8") or (quant and saved_dtype not in ("float32", "bfloat16", "float16")):
            raise ValueError(f"quant {quant!r} with dtype {saved_dtype!r} is not what jaxllm writes")
        digests = _digests_from_json(meta_json)
    except ValueError as e:
        raise ValueError(f"{config_file}: {e}") from None
    if not (directory / "params").is_dir():
        raise ValueError(f"{directory}: the converted checkpoint has no params/ directory")
    with _reading(directory), ocp.StandardCheckpointer() as ckpt:
        meta = ckpt.metadata(directory / "params")
        meta_tree = getattr(meta, "item_metadata", meta)
        meta_tree = getattr(meta_tree, "tree", meta_tree)
        saved = {name: jnp.dtype(m.dtype) for name, m in _named_leaves(meta_tree)}
    if not saved:
        raise ValueError(f"{directory}: the converted checkpoint's params/ lists no arrays (its "
                         "_METADATA or manifest.ocdbt is missing or damaged): convert it again")
    if quant == "int8":
        if mesh is not None:
            raise ValueError(f"{directory} holds int8 weights, which restore onto one device only; "
                             "convert without --quant to shard it")
        return _restore_quantized(directory, cfg, jnp.dtype(dtype or saved_dtype), saved, digests)
    stored = abstract_params(cfg, jnp.float32)
    dtype = next(iter(saved.values())) if dtype is None else jnp.dtype(dtype)

    if mesh is None:
        device = NamedSharding(Mesh(np.array(jax.local_devices()[:1]), ("one",)), P())
        target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype, sharding=device), stored)
        return _from_tree(_read(directory, _to_tree(target), saved, digests), stored)

    layout, tp = sharding.plan(cfg, mesh, expert_parallel)
    r = tp.kv_replicas
    axes = {f"layers.{i}.{n}": s.axes for i in range(cfg.num_layers) for n, s in layer_specs(layout, i).items()}
    axes.update({n: s.axes for n, s in top_specs(layout).items()})
    # Repeated KV heads with one copy per device (tp = K * r): read them through a (K, r) view of
    # the mesh, device (k, j) holding KV group k whole (wqkv, bqkv) or its j-th query heads (wo).
    grouped = r > 1 and layout.num_kv_heads == tp.size
    mesh2 = Mesh(mesh.devices.reshape(cfg.num_kv_heads, r), ("kv", "rep")) if grouped else None

    def target_of(path: str, s):
        name = path.rsplit(".", 1)[-1]
        if r > 1 and name in ("wqkv", "bqkv", "wo"):
            if not grouped:  # each device reads the whole tensor, keeps its part (see _relayout)
                spec = NamedSharding(mesh, P())
            else:
                spec = NamedSharding(mesh2, P(None, "kv", "rep") if name == "wo" else P("kv"))
        else:
            spec = NamedSharding(mesh, sharding._spec(tp, axes[path]))
        return jax.ShapeDtypeStruct(s.shape, dtype, sharding=spec)

    paths = leaf_paths(stored)
    target = jax.tree.unflatten(jax.tree.structure(stored),
                                [target_of(p, s) for p, s in zip(paths, jax.tree.leaves(stored))])
    params = _from_tree(_read(directory, _to_tree(target), saved, digests), target)
    if r > 1:
        params = _relayout(params, cfg, layout, tp, mesh2)
    return params.replace(config=layout, tp=tp)


def _digests_from_json(d: dict) -> dict[str, str]:
    digests = d.get("digests")
    if not (isinstance(digests, dict) and digests and all(
            isinstance(v, str) and re.fullmatch("[0-9a-f]{8}", v) for v in digests.values())):
        raise ValueError("digests must map each array's path to 8 hex digits: convert it again")
    return digests


CAST_PARTS = 8  # a restore that casts reads the arrays in about this many parts


def _read(directory: Path, target: dict, saved: dict[str, np.dtype], digests: dict[str, str]) -> dict:
    """`target` (nested dicts of ShapeDtypeStructs) restored from params/: each array read in the
    dtype it was saved in (`saved`, by path), checked against its digest, then cast to the target's
    dtype. Where arrays are cast, they are read a part at a time (about 1/CAST_PARTS of the bytes),
    so that the model in its saved dtype is never whole on the devices beside its cast copy."""
    named = _named_leaves(target)
    unlisted, unread = sorted({n for n, _ in named} - digests.keys()), sorted(digests.keys() - {n for n, _ in named})
    if unlisted or unread:
        raise ValueError(f"{directory / CONFIG_FILE}: no digests for {unlisted[:3]} / digests for arrays the "
                         f"model does not have {unread[:3]}: convert it again")
    as_saved = {n: jax.ShapeDtypeStruct(t.shape, saved.get(n, t.dtype), sharding=t.sharding) for n, t in named}
    size = {n: int(np.prod(s.shape)) * s.dtype.itemsize for n, s in as_saved.items()}
    parts, part, held = [], [], 0
    casts = any(as_saved[n].dtype != t.dtype for n, t in named)
    share = sum(size.values()) / CAST_PARTS
    for n, _ in named:  # consecutive arrays (a layer's lie together) up to the part's share of bytes
        if part and casts and held + size[n] > share:
            parts.append(part)
            part, held = [], 0
        part.append(n)
        held += size[n]
    parts.append(part)
    done, wanted = {}, dict(named)
    for part in parts:
        found = _restore_part(directory, {n: as_saved[n] for n in part}, whole=len(parts) == 1)
        sums = _digests(found)
        damaged = [n for n in part if sums[n] != digests[n]]
        if damaged:
            raise ValueError(f"{directory}: the converted checkpoint's params/ is damaged: "
                             f"{', '.join(damaged[:3])}{' and more' if len(damaged) > 3 else ''} read back "
                             "other bits than were saved (their digests differ): convert it again")
        narrowed = []
        for n, x in _named_leaves(found):
            want = wanted[n].dtype
            done[n] = x if x.dtype == want else x.astype(want)
            if done[n] is not x:
                x.delete()  # the saved dtype's copy goes as soon as its cast is made
                if jnp.issubdtype(want, jnp.floating) and jnp.finfo(want).max < jnp.finfo(x.dtype).max:
                    narrowed.append(n)
        # The saved values are finite (checked as the source was read, and by the digests since);
        # an infinity now is a value past the narrower dtype's range, as 1e6 in float16.
        finite = jax.device_get([jnp.isfinite(done[n]).all() for n in narrowed])
        if not all(finite):
            over = [n for n, ok in zip(narrowed, finite) if not ok]
            raise ValueError(f"{directory}: {', '.join(over[:3])}{' and more' if len(over) > 3 else ''} hold values "
                             f"past what {wanted[over[0]].dtype} can hold (they would become infinite): restore "
                             "the checkpoint in a wider dtype")
    return jax.tree.unflatten(jax.tree.structure(target), [done[n] for n, _ in named])


def _restore_part(directory: Path, arrays: dict[str, jax.ShapeDtypeStruct], whole: bool) -> dict:
    """The arrays named ("layers.3.wqkv") restored from params/, as nested dicts."""
    import orbax.checkpoint as ocp

    item: dict = {}
    for name, s in arrays.items():
        *outer, last = name.split(".")
        node = item
        for key in outer:
            node = node.setdefault(key, {})
        node[last] = s
    with _reading(directory):
        if whole:
            with ocp.StandardCheckpointer() as ckpt:
                return ckpt.restore(directory / "params", item)
        with ocp.PyTreeCheckpointer() as ckpt:
            return ckpt.restore(directory / "params", args=ocp.args.PyTreeRestore(
                item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True))


@contextlib.contextmanager
def _reading(directory: Path):
    """Any failure of orbax or tensorstore reading params/ (a missing, truncated or corrupted
    file raises a bare `Exception`) as a ValueError naming the checkpoint, the original its cause."""
    try:
        yield
    except Exception as e:
        # tensorstore's first line says what failed; a dump of its spec follows
        problem = (str(e).strip().splitlines() or [""])[0].split(" See full TensorStore details")[0][:300]
        raise ValueError(f"{directory}: cannot read the converted checkpoint's params/: "
                         f"{type(e).__name__}: {problem}") from e


def _restore_quantized(directory: Path, cfg: ModelConfig, dtype, saved: dict[str, np.dtype],
                       digests: dict[str, str]) -> Params:
    """An int8 checkpoint onto the default device: int8 values and float32 scales as saved, the
    other weights (norms, biases, an untied embedding) cast to `dtype`."""
    template = jax.eval_shape(quantize_params, abstract_params(cfg, dtype))
    device = NamedSharding(Mesh(np.array(jax.local_devices()[:1]), ("one",)), P())
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), template)
    return _from_tree(_read(directory, _to_tree(target), saved, digests), template)


def _relayout(params: Params, cfg: ModelConfig, layout: ModelConfig, tp, mesh2: Mesh | None) -> Params:
    """wqkv, bqkv, wo restored in the checkpoint layout -> the layout with repeated KV heads."""
    r, G = tp.kv_replicas, cfg.q_per_kv
    shardings = sharding.param_shardings(layout, tp)

    def fix(name, x, target_sharding):
        new_shape = _layout_shape(name, x.shape, cfg, r)
        if mesh2 is None:  # replicated read: transform, keep each device's slice
            return jax.jit(lambda a: sharding.to_layout(name, a, cfg, r), out_shardings=target_sharding)(x)
        if name == "wo":  # [D, 1, G/r, H] per device already
            shards = [s.data for s in x.addressable_shards]
        else:  # [1, G+2, H, (D)] per device: keep query heads j*G/r.. of the group, and k, v
            coords = {d: j for (_, j), d in np.ndenumerate(mesh2.devices)}
            shards = []
            for s in x.addressable_shards:
                j = coords[s.device]
                shards.append(jnp.concatenate([s.data[:, j * (G // r):(j + 1) * (G // r)], s.data[:, G:]], axis=1))
        return jax.make_array_from_single_device_arrays(new_shape, target_sharding, shards)

    layers = []
    for layer, target in zip(params.layers, shardings.layers):
        updates = {n: fix(n, getattr(layer, n), getattr(target, n))
                   for n in ("wqkv", "bqkv", "wo") if getattr(layer, n) is not None}
        layers.append(layer.replace(**updates))
    return params.replace(layers=layers)


def _layout_shape(name: str, shape: tuple, cfg: ModelConfig, r: int) -> tuple:
    K, G = cfg.num_kv_heads, cfg.q_per_kv
    if name == "wo":
        return (shape[0], K * r, G // r, *shape[3:])
    return (K * r, G // r + 2, *shape[2:])
