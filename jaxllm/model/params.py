"""Parameter pytrees and the one table that declares every parameter.

`layer_specs` / `top_specs` declare each parameter once: its shape, logical axes (for sharding),
how it is initialised, and which Hugging Face tensors it is converted from. Random init,
abstract shapes, shardings and checkpoint conversion are all derived from that table.

Layout, converted once at load time so the decode step needs no transposes. Every matrix keeps
its contraction axes last (minor), as in a HF [out, in] Linear: at batch 1 each output is a
contiguous dot product, which XLA's GEMV kernels stream near HBM bandwidth; with the contraction
axis major, the H200 measured 2 TB/s instead of ~3.8, and XLA transposed wo inside the loop.
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
import queue
import re
import threading
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxllm.config import ModelConfig
from jaxllm.quant import weight_leaves


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
    q_norm: jax.Array | None = None  # [H] (Qwen3)
    k_norm: jax.Array | None = None  # [H]
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
    # None on one device; a `jaxllm.sharding.TensorParallel` (mesh and split axes) when sharded.
    tp: Any = struct.field(pytree_node=False, default=None)

    @property
    def dtype(self):
        return self.embed.dtype


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter: shape, logical axes, init, and its source tensors in a HF checkpoint."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # logical axis names: "vocab", "heads_kv", "ffn", "experts"
    init: str  # "normal" | "ones" | "zeros"
    hf: tuple[tuple[str, tuple[int, ...]], ...]  # (name, shape) of each source tensor
    # The parameter's array -> one view of it per source tensor (in hf order), where that
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
    p = f"model.layers.{i}."

    def qkv_parts(out):  # [K, G+2, H, (D)]: q [N*H, (D)] as [K, G, H], then k and v [K*H, (D)]
        return out[:, :G], out[:, G:G + 1], out[:, G + 1:]
    specs = {
        "attn_norm": ParamSpec((D,), (None,), "ones", ((p + "input_layernorm.weight", (D,)),), _whole),
        "wqkv": ParamSpec(
            (K, G + 2, H, D), ("heads_kv", None, None, None), "normal",
            ((p + "self_attn.q_proj.weight", (N * H, D)), (p + "self_attn.k_proj.weight", (K * H, D)),
             (p + "self_attn.v_proj.weight", (K * H, D))), qkv_parts),
        "wo": ParamSpec((D, K, G, H), (None, "heads_kv", None, None), "normal",
                        ((p + "self_attn.o_proj.weight", (D, N * H)),),
                        _whole),
        "mlp_norm": ParamSpec((D,), (None,), "ones",
                              ((p + "post_attention_layernorm.weight", (D,)),), _whole),
    }
    if cfg.qkv_bias:
        specs["bqkv"] = ParamSpec(
            (K, G + 2, H), ("heads_kv", None, None), "zeros",
            ((p + "self_attn.q_proj.bias", (N * H,)), (p + "self_attn.k_proj.bias", (K * H,)),
             (p + "self_attn.v_proj.bias", (K * H,))), qkv_parts)
    if cfg.o_bias:
        specs["bo"] = ParamSpec((D,), (None,), "zeros", ((p + "self_attn.o_proj.bias", (D,)),), _whole)
    if cfg.qk_norm:
        specs["q_norm"] = ParamSpec((H,), (None,), "ones", ((p + "self_attn.q_norm.weight", (H,)),), _whole)
        specs["k_norm"] = ParamSpec((H,), (None,), "ones", ((p + "self_attn.k_norm.weight", (H,)),), _whole)
    if cfg.is_moe(i):
        specs.update(moe_specs(cfg, i))
    else:
        specs["w_gate_up"] = ParamSpec(
            (2, F, D), (None, "ffn", None), "normal",
            ((p + "mlp.gate_proj.weight", (F, D)), (p + "mlp.up_proj.weight", (F, D))),
            _leading)
        specs["w_down"] = ParamSpec((D, F), (None, "ffn"), "normal",
                                    ((p + "mlp.down_proj.weight", (D, F)),), _whole)
    return specs


def moe_specs(cfg: ModelConfig, i: int) -> dict[str, ParamSpec]:
    """Router and stacked experts of a sparse layer, from per-expert HF tensors."""
    D, E, F = cfg.hidden_size, cfg.num_experts, cfg.moe_ffn_size
    p = f"model.layers.{i}."
    if cfg.model_type == "mixtral":
        router = p + "block_sparse_moe.gate.weight"
        gate, up, down = (p + f"block_sparse_moe.experts.{{e}}.{w}.weight" for w in ("w1", "w3", "w2"))
    else:
        router = p + "mlp.gate.weight"
        gate, up, down = (p + f"mlp.experts.{{e}}.{w}.weight" for w in ("gate_proj", "up_proj", "down_proj"))
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


def top_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    V, D = cfg.vocab_size, cfg.hidden_size
    specs = {
        "embed": ParamSpec((V, D), ("vocab", None), "normal", (("model.embed_tokens.weight", (V, D)),),
                           _whole),
        "final_norm": ParamSpec((D,), (None,), "ones", (("model.norm.weight", (D,)),), _whole),
    }
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((V, D), ("vocab", None), "normal", (("lm_head.weight", (V, D)),),
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


class TensorSource(Protocol):
    """HF-named tensors as `from_hf_tensors` reads them (`hf.SafetensorsReader`, `hf.ArraySource`)."""

    shapes: dict[str, tuple[int, ...]]

    def dtype(self, name: str) -> np.dtype: ...

    def position(self, name: str) -> tuple[int, int]: ...  # where its bytes lie: reads go in order

    def read_into(self, name: str, view: np.ndarray) -> None: ...  # the values, in C order


_LAYER_INDEX, _EXPERT_INDEX = re.compile(r"^model\.layers\.(\d+)\."), re.compile(r"\.experts\.(\d+)\.")


def from_hf_tensors(cfg: ModelConfig, source: TensorSource, dtype=jnp.float32,
                    place: Callable[[str, np.ndarray], Any] | None = None,
                    progress: Callable[[int], None] | None = None, threads: int = 1,
                    buffer_bytes: int = 1 << 32) -> Params:
    """Convert HF-named tensors into Params, checking the set of names and every shape first.

    `source` holds the tensors (see `TensorSource`). Each parameter is made in host memory by
    reading its sources into their parts of it (no copy), then `place(path, array)` (default:
    jnp.asarray) puts it on its device(s). A missing, unexpected or misshapen tensor is a
    ValueError naming it, raised before anything is read.

    With `threads` > 1, that many threads read parameters, the largest first and otherwise in
    the order of their bytes, and as many place them as they come: the disk keeps reading while
    the device takes what was read, with at most `buffer_bytes` read but not yet placed.
    (`place` and `progress` then run on those threads.)
    """
    # A damaged count in the config would first make a name for each of its layers and experts.
    for what, pattern, count in (("layers", _LAYER_INDEX, cfg.num_layers),
                                 ("experts", _EXPERT_INDEX, cfg.num_experts)):
        held = {m.group(1) for n in source.shapes if (m := pattern.search(n))}
        if count > len(held):
            raise ValueError(f"the config has {count} {what}, but the checkpoint holds tensors of "
                             f"{len(held)} {what} only")
    jobs = named_specs(cfg)
    expected = {name: shape for _, s in jobs for name, shape in s.hf}
    # Checkpoints often carry the rotary inv_freq buffer; it is derived from the config instead.
    present = {n for n in source.shapes if not n.endswith("rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        present.discard("lm_head.weight")  # some tied checkpoints still store a copy
    missing = sorted(set(expected) - present)
    unexpected = sorted(present - set(expected))
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {', '.join(missing[:8])}"
                         + (" ..." if len(missing) > 8 else ""))
    if unexpected:
        raise ValueError(f"checkpoint has {len(unexpected)} unexpected tensor(s): "
                         f"{', '.join(unexpected[:8])}" + (" ..." if len(unexpected) > 8 else ""))
    for name, shape in expected.items():
        if tuple(source.shapes[name]) != shape:
            raise ValueError(f"tensor {name} has shape {tuple(source.shapes[name])}, expected "
                             f"{shape} from the config")
    place = place or (lambda path, x: jnp.asarray(x, dtype))
    host_dtype = {path: np.result_type(*(source.dtype(name) for name, _ in s.hf)) for path, s in jobs}

    def read(path: str, s: ParamSpec) -> np.ndarray:
        out = np.empty(s.shape, host_dtype[path])
        parts = list(zip(s.hf, s.parts(out), strict=True))
        for (name, _), part in parts:
            source.read_into(name, part)
        if first_nonfinite(out, dtype) is not None:  # the source tensor and index named: a rare path
            for (name, shape), part in parts:
                part = np.ascontiguousarray(part)  # in the source's C order (`read_into`)
                if (at := first_nonfinite(part, dtype)) is not None:
                    at = tuple(int(i) for i in np.unravel_index(np.ravel_multi_index(at, part.shape), shape))
                    value = part.reshape(shape)[at]
                    if np.isfinite(value):
                        inf = "-inf" if value < 0 else "inf"
                        raise ValueError(f"tensor {name} holds {value} at index {at}, past what "
                                         f"{jnp.dtype(dtype).name} can hold (it would become {inf}): "
                                         "load the checkpoint in a wider dtype")
                    raise ValueError(f"tensor {name} holds {value} at index {at}: "
                                     "the checkpoint is damaged (a weight must be a finite number)")
        return out

    def put(path: str, s: ParamSpec, x: np.ndarray):
        out = place(path, x)
        if progress:
            progress(sum(int(np.prod(shape)) for _, shape in s.hf))
        return out
    if threads <= 1:
        return _assemble(cfg, lambda path, s: put(path, s, read(path, s)))
    size = {path: int(np.prod(s.shape)) * host_dtype[path].itemsize for path, s in jobs}
    # Largest first: the last parameters read are small, so little is left to place once the
    # disk is done (the 8B shape's 1 GB embed and lm_head, last, took 0.5-0.7 s each after it).
    jobs.sort(key=lambda job: (-size[job[0]], source.position(job[1].hf[0][0])))
    placed = _read_then_place(jobs, read, put, size, threads, buffer_bytes)
    return _assemble(cfg, lambda path, s: placed[path])


# Bits of each float format's exponent: a value with all of them set is NaN or infinity. Read on
# the bits, a piece at a time so that it stays in cache: numpy's isfinite on bfloat16 ran at 2.4
# GB/s a thread, this at 5.0 (a 2-core CPU), while the disk gives the reader 2 GB/s at most.
_EXPONENT_BITS = {np.dtype(np.float16): 0x7C00, np.dtype(jnp.bfloat16): 0x7F80,
                  np.dtype(np.float32): 0x7F800000, np.dtype(np.float64): 0x7FF0000000000000}
_CHECK_PIECE = 1 << 20  # elements


@functools.cache
def _unfit_bits(source: np.dtype, target: np.dtype) -> int:
    """The bits, sign aside, of the smallest `source` magnitude that is not a finite number in
    `target` (infinity where `target` holds every finite `source` value): each larger one, NaN
    and infinity included, is not either, since magnitudes order as their bits do."""
    unsigned = np.dtype(f"u{source.itemsize}")
    fits, unfit = 0, _EXPONENT_BITS[source]  # zero fits; infinity does not
    while unfit - fits > 1:
        mid = (fits + unfit) // 2
        with np.errstate(over="ignore", invalid="ignore"):
            finite = np.isfinite(np.array(mid, unsigned).view(source).astype(target))
        if finite:
            fits = mid
        else:
            unfit = mid
    return unfit


def first_nonfinite(x: np.ndarray, dtype=None) -> tuple[int, ...] | None:
    """The index of the first NaN or infinity in a C-contiguous array, or of the first value that
    would become one cast to `dtype` (too large for it); None if there is none (and for integer
    arrays)."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return None
    target = x.dtype if dtype is None else np.dtype(jnp.dtype(dtype))
    known = x.dtype in _EXPONENT_BITS
    limit = _unfit_bits(x.dtype, target) if known else None
    magnitude = _EXPONENT_BITS[x.dtype] | (_EXPONENT_BITS[x.dtype] - 1) if known else None
    flat = x.reshape(-1)
    for start in range(0, flat.size, _CHECK_PIECE):
        piece = flat[start:start + _CHECK_PIECE]
        if known:
            bad = (piece.view(f"u{x.dtype.itemsize}") & magnitude) >= limit
        else:  # float8 and the like: no bit pattern shared by all their NaNs
            with np.errstate(over="ignore", invalid="ignore"):
                bad = ~np.isfinite(piece.astype(target))
        if bad.any():
            return tuple(int(i) for i in np.unravel_index(start + int(np.argmax(bad)), x.shape))
    return None


def _read_then_place(jobs: list[tuple[str, ParamSpec]], read, put, size: dict[str, int],
                     threads: int, buffer_bytes: int) -> dict[str, Any]:
    """`threads` threads read the jobs in order, `threads` more place what was read, as it comes;
    a reader waits while `buffer_bytes` are read and not yet placed (unless nothing is, so one
    larger job still goes). The first failure stops both and is raised."""
    todo, ready = iter(jobs), queue.Queue()
    held, failures, placed = 0, [], {}
    moved = threading.Condition()

    def reader():
        nonlocal held
        while True:
            with moved:
                job = next(todo, None)
                while job and held and held + size[job[0]] > buffer_bytes and not failures:
                    moved.wait()
                if job is None or failures:
                    return
                held += size[job[0]]
            try:
                ready.put((job, read(*job)))
            except BaseException as e:  # noqa: BLE001 - raised by the caller below
                with moved:
                    failures.append(e)
                    held -= size[job[0]]
                    moved.notify_all()
                return

    def placer():
        nonlocal held
        while (item := ready.get()) is not None:
            (path, s), x = item
            failure = None
            try:
                if not failures:  # placed in full before its host memory counts as free
                    placed[path] = jax.block_until_ready(put(path, s, x))
            except BaseException as e:  # noqa: BLE001
                failure = e
            del item, x
            with moved:
                if failure is not None:
                    failures.append(failure)
                held -= size[path]
                moved.notify_all()
    readers = [threading.Thread(target=reader, name=f"jaxllm-read-{i}") for i in range(threads)]
    placers = [threading.Thread(target=placer, name=f"jaxllm-place-{i}") for i in range(threads)]
    for t in readers + placers:
        t.start()
    try:
        for t in readers:
            t.join()
    except BaseException as e:  # Ctrl-C: the threads stop after the reads and places under way
        with moved:
            failures.append(e)
            moved.notify_all()
        raise
    finally:
        for _ in placers:
            ready.put(None)
    for t in placers:
        t.join()
    if failures:
        raise failures[0]
    return placed
