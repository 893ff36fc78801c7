"""The step plan: for (params, batch rows, tokens per row) one host-side object that says which
kernel, tiles and fusions each matrix, the attention, the add+norm pairs and the lm_head take.

`transformer` reads it and asks the kernels nothing; the kernels say only what they support (hard
limits). Everything here is static (shapes, dtypes, which leaves are int8), so a plan is made while
a step is traced, or ahead of it, and is hashable: a jit static argument. The figures behind each
rule are in docs/decisions/.
"""

from __future__ import annotations

import dataclasses
import math

from jaxllm import runtime
from jaxllm.kernels.common import GATES, can_prefetch, mode
from jaxllm.kernels.decode_attention import supports as attention_supports
from jaxllm.kernels.digits import supports as digits_supports
from jaxllm.kernels.probe import compiles
from jaxllm.kernels.project import int8_tiled, supports as project_supports
from jaxllm.kernels.rows_project import rows_tiles
from jaxllm.kernels.tuning import KernelTuning, current
from jaxllm.layers.quant import QuantizedWeight, stored
from jaxllm.model.config import ModelConfig, rope_frequencies
from jaxllm.model.params import Params


@dataclasses.dataclass(frozen=True)
class Projection:
    """How a matrix is multiplied: `family` "project" (one row), "rows" (8-32 rows) or None (XLA),
    under `mode` ("gpu" or "interpret")."""
    family: str | None = None
    mode: str | None = None
    tuning: KernelTuning = dataclasses.field(default_factory=current)


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """One decoder block's choices (static, hashable: layers of one shape share one)."""
    cfg: ModelConfig
    window: int | None  # the sliding window, or None
    moe: bool
    rope_scale: float  # the cos/sin scale of the layer's rope (Gemma 3's local layers have their own)
    axis: str | None  # the tensor-parallel axis inside shard_map
    projection: Projection  # qkv, o, and (with ffn_kernel) gate/up and down
    add_norm: str | None  # mode of the residual add + norm pairs (None: XLA's add, norm by the consumer)
    attention: str | None  # decode attention kernel's mode (None: XLA's form)
    split_out: bool  # the attention may hand o its splits uncombined
    route: str | None  # MoE routing kernel's mode
    ffn_kernel: bool  # gate/up and down through `projection` (else XLA's mlp / moe)
    ffn_norm_folded: bool  # the FFN's norm in gate/up's kernel; then o's kernel adds the residual
    ffn_digits: bool  # the FFN's normed row as int8 digits for gate/up
    down_digits: bool  # gate/up hands down its output as digits
    next_folds: bool  # down adds the residual and the next matrix folds its norm in
    next_digits: bool  # the next norm's row as digits (for the int8 lm_head)
    prefetch: tuple[bool, bool, bool, bool] = (False,) * 4  # qkv asks L2 for o, o for gate/up, ...
    gate_up_wide: bool | None = None  # gate/up programs twice as wide (None: the tuning's)
    weights_first: bool = False  # the projections load weights before their input


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """A step's choices: its layers' plans, the lm_head's projection, and which layers' gate/up
    write digits for down (their order in `digits.down_bounds`)."""
    layers: tuple[LayerPlan, ...]
    head: Projection
    attention: str | None
    down_layers: tuple[int, ...]
    tuning: KernelTuning
    axis: str | None = None


@dataclasses.dataclass(frozen=True)
class ModelFusions:
    """Which of the block kernels' fusions a model's arithmetic allows (`model_fusions`). Every
    model's matrices take the projection kernels as plain products, its attention the decode
    kernels (whose switches hold Gemma's score scale, soft cap, (1 + w) q/k norms and a rotation
    table a rope) and its residual adds `add_norm` (which norms by (1 + w) and takes Gemma's
    post-norms); what a kernel cannot express is a fusion turned off here, for that model only."""
    fold_norms: bool  # a norm folds into `project`'s product as x * w: not Gemma's (1 + w) ones
    fold_residual: bool  # o and down add the residual: no norm of their output first (Gemma's post-norms)
    gate_kernel: bool  # gate/up's kernels compute the gate's activation (`kernels.common.GATES`)
    digits: bool  # gate/up may take its input as int8 digits: the digits kernel's gate is silu


def model_fusions(cfg: ModelConfig) -> ModelFusions:
    """The one place where a model feature turns a fusion off. (The final logits' soft cap is
    applied to the lm_head's output whichever path made it, and the embedding scale to the
    lookup: neither is a kernel's.)"""
    return ModelFusions(fold_norms=cfg.norm_offset == 0.0, fold_residual=not cfg.post_norms,
                        gate_kernel=cfg.activation in GATES, digits=cfg.activation == "silu")


# --- the rules, one a kernel family (figures: docs/decisions/)

def score_switches(cfg: ModelConfig) -> dict:
    """The attention kernels' static switches for the model's scores and q/k norms: its score scale
    (Gemma's query_pre_attn_scalar), soft cap (Gemma 2) and norm offset (Gemma 3's (1 + w))."""
    return dict(scale=cfg.attn_scale, softcap=cfg.attn_logit_softcap, norm_offset=cfg.norm_offset)


def decode_attention_mode(dtype, head_dim: int, rotary_dim: int, kv_int8: bool, cache_length: int,
                          tuning: KernelTuning | None = None, tokens: int = 1,
                          q_per_kv: int = 1, **switches) -> str | None:
    """"gpu", "interpret" or None (XLA's form): whether a decode step's attention takes the kernel
    (`decode_attention`; a verify step's `tokens` a row, of `q_per_kv` queries a KV head,
    `verify_attention`): a float16/bfloat16 model (float32 keeps XLA's exact form) within the
    kernel's limits."""
    t = tuning or current()
    m = mode(t.decode_attention, dtype, "decode_attention")
    if m is None or not attention_supports(head_dim, rotary_dim, kv_int8, cache_length, m == "gpu",
                                           tokens, q_per_kv):
        return None
    # compiled at the model's head size, group and score `switches` (scale, softcap, norm_offset,
    # qk_norm): a Gemma's heads of 256 ask the GPU more than the probe's default
    return compiles("decode_attention" if tokens == 1 else "verify_attention", m, t, head_dim=head_dim,
                    q_per_kv=q_per_kv, **switches)


def verify_step(tokens_per_row: int, fresh: bool, tuning: KernelTuning | None = None) -> bool:
    """Whether a step is a verify step, which takes the decode kernels' few-token forms: 2 to
    `verify_tokens` new tokens a row into a warm cache (not `fresh`), as speculative decoding's
    check of k drafted tokens writes k + 1 (docs/decisions/verify-step.md)."""
    return not fresh and 1 < tokens_per_row <= (tuning or current()).verify_tokens


def decode_project_mode(dtype, rows: int, tuning: KernelTuning | None = None) -> str | None:
    """Whether a decode step's projections take `project`'s kernel: one row (batch 1)."""
    t = tuning or current()
    return (compiles("project", mode(t.decode_project, dtype, "project", t.project_backend), t)
            if rows == 1 else None)


def add_norm_mode(dtype, tuning: KernelTuning | None = None) -> str | None:
    """Whether residual add + norm pairs take `add_norm`'s kernel."""
    t = tuning or current()
    return compiles("add_norm", mode(t.add_norm, dtype, "add_norm", t.add_norm_backend), t)


def route_mode(dtype, tuning: KernelTuning | None = None) -> str | None:
    """Whether MoE routing takes `route`'s kernel."""
    t = tuning or current()
    return compiles("route", mode(t.route, dtype, "route"), t)


def rows_project_mode(dtype, rows: int, tuning: KernelTuning | None = None,
                      least: int | None = None) -> str | None:
    """Whether a decode step of `rows` rows (`least`, by default rows_min, to rows_max) takes
    `rows_project`'s kernel; below rows_any_size rows only for large matrices (`rows_sized`)."""
    t = tuning or current()
    least = t.rows_min if least is None else least
    if not least <= rows <= t.rows_max:
        return None
    return compiles("rows_project", mode(t.rows_project, dtype, "rows_project"), t)


def rows_sized(rows: int, shapes, tuning: KernelTuning | None = None) -> bool:
    """Whether matrices of these (outputs, channels) `shapes` take the kernel at `rows` rows: from
    rows_any_size rows all do, below it those of at least rows_large_weights weights each
    (docs/decisions/rows-project.md#8-31-rows-only-for-large-matrices)."""
    t = tuning or current()
    return rows >= t.rows_any_size or all(math.prod(s) >= t.rows_large_weights for s in shapes)


def prefetched(w, tuning: KernelTuning | None = None) -> bool:
    """Whether a kernel asks L2 for matrix w (a `QuantizedWeight`'s int8 bytes) ahead of its use:
    on a GPU from Hopper on, at most prefetch_max_bytes
    (docs/decisions/one-row-projection.md#l2-prefetch-of-the-next-matrix)."""
    t = tuning or current()
    if w is None or not can_prefetch() or stored(w).size * stored(w).dtype.itemsize > t.prefetch_max_bytes:
        return False
    return compiles("l2_prefetch", "gpu", t) is not None  # an ask that fails to compile: none


def weights_first(matrices, tuning: KernelTuning | None = None) -> bool:
    """Whether a layer's projection kernels load their weights before their input: where every one
    of its `matrices` is a float matrix that `prefetched` (docs/decisions/one-row-projection.md#weights-before-the-input)."""
    t = tuning or current()
    return t.weights_first and all(w is not None and not isinstance(w, QuantizedWeight)
                                   and prefetched(w, t) for w in matrices)


def project_folds_norm(w_NC, mode: str | None, swiglu: bool = False, biased: bool = False,
                       tuning: KernelTuning | None = None) -> bool:
    """Whether the norm before w folds into `project`'s kernel (one row, under `mode`): where the
    kernel takes w, unless w is a large int8 matrix (docs/decisions/int8.md#the-norm-apart)."""
    t = tuning or current()
    return (mode is not None and project_supports(w_NC, swiglu, biased, t)
            and not (t.int8_norm_apart and int8_tiled(w_NC, t)))


def project_digits(w_NC, mode: str | None, swiglu: bool = False, biased: bool = False,
                   tuning: KernelTuning | None = None) -> bool:
    """Whether the norm before w should come as a `DigitRow` for the int8 tensor-core kernel:
    SwiGLU's large int8 gate/up (its norm apart), or an int8 matrix past kernel_max_int8_weights
    without bias (the lm_head), where `digits.supports` it (docs/decisions/int8.md)."""
    t = tuning or current()
    if not (t.int8_digits and mode is not None and isinstance(w_NC, QuantizedWeight)) or biased:
        return False
    if swiglu:
        if not project_supports(w_NC, swiglu, tuning=t) or project_folds_norm(w_NC, mode, swiglu, tuning=t):
            return False
    elif not (t.int8_head_digits and math.prod(w_NC.shape) > t.kernel_max_int8_weights):
        return False
    return digits_supports(w_NC, "gate_up" if swiglu else "head", t)


def down_digits(w_NC, mode: str | None, tuning: KernelTuning | None = None) -> bool:
    """Whether a down projection w [D, F] takes gate/up's output as digits: a large int8 matrix that
    `project`'s kernel takes, in programs at least 3/4 of the multiprocessors
    (docs/decisions/int8.md#int8-digits-down-from-gateups-output). The layer also needs its
    gate/up from digits and no residual in down's product."""
    t = tuning or current()
    return (t.int8_digits and t.int8_down_digits and mode is not None
            and int8_tiled(w_NC, t) and w_NC.ndim == 2
            and project_supports(w_NC, tuning=t) and digits_supports(w_NC, "down", t)
            and 4 * (w_NC.shape[0] // t.down_digit_tiles[0]) >= 3 * runtime.multiprocessors())


def _rows_mode(params: Params, B: int, T: int, axis, fresh: bool, t: KernelTuning) -> str | None:
    """Whether a step's blocks take the rows family: a decode step (not inside shard_map) of
    rows_min to rows_max rows of a dense float model whose every matrix the kernel's tiles divide
    and, below rows_any_size rows, is large (`rows_sized`). A verify step's B*T tokens are rows
    as a decode step's are, from verify_rows_min."""
    verify = verify_step(T, fresh, t)
    if not (T == 1 or verify) or fresh or axis is not None or params.config.num_experts:
        return None
    rows = B * T
    m = rows_project_mode(params.dtype, rows, t, t.verify_rows_min if verify else None)

    def divided(layer):  # (outputs, channels) of qkv, o, gate/up and down
        qkv, o, gate_up, down = layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down
        shapes = ((math.prod(qkv.shape[:-1]), qkv.shape[-1]), (o.shape[0], math.prod(o.shape[1:])),
                  gate_up.shape[1:], down.shape)
        return (not isinstance(qkv, QuantizedWeight) and rows_sized(rows, shapes, t)
                and all(rows_tiles(*shape, t) for shape in shapes))
    return m if m and all(divided(layer) for layer in params.layers) else None


def step_plan(params: Params, rows: int, tokens_per_row: int, tuning: KernelTuning | None = None,
              axis: str | None = None, fresh: bool = False, *, cache_length: int | None = None,
              kv_int8: bool = False) -> StepPlan:
    """The plan of a step of `rows` rows of `tokens_per_row` new tokens each. `axis`: the
    tensor-parallel axis (inside shard_map: no one-row or rows kernels, no add_norm); `fresh`: a
    prefill into an empty cache; `cache_length` and `kv_int8`: the cache's, for the attention
    kernel (None: XLA's attention). A `verify_step` (2-9 tokens a row on a warm cache) takes the
    attention kernel's few-token form and, from verify_rows_min tokens in all, the rows kernels;
    its lm_head, as a prefill's, XLA's."""
    t = tuning or current()
    cfg, B, T = params.config, rows, tokens_per_row
    rope_scale = {rope: rope_frequencies(cfg, rope=rope)[1] for rope in cfg.ropes}
    # the channels each rope rotates: the kernel rotates whole heads only
    rotary_dim = min(2 * len(rope_frequencies(cfg, rope=rope)[0]) for rope in cfg.ropes)
    f = model_fusions(cfg)
    proj = decode_project_mode(params.dtype, B, t) if T == 1 and axis is None else None
    attention = None
    if (T == 1 or verify_step(T, fresh, t)) and not fresh and cache_length is not None:
        attention = decode_attention_mode(params.dtype, cfg.head_dim, rotary_dim, kv_int8,
                                          cache_length, t, tokens=T, q_per_kv=cfg.q_per_kv,
                                          qk_norm=cfg.qk_norm, **score_switches(cfg))
    fuse = None if axis is not None or (T == 1 and proj is None) else add_norm_mode(params.dtype, t)
    rows_mode = _rows_mode(params, B, T, axis, fresh, t)
    route = route_mode(params.dtype, t) if axis is None else None
    head_w = params.embed if params.lm_head is None else params.lm_head
    # What the residual stream feeds after each layer: the next layer's qkv, or the lm_head.
    nexts = [(nxt.wqkv, nxt.bqkv is not None) for nxt in params.layers[1:]] + [(head_w, False)]
    next_takes = [proj is not None and f.fold_norms and project_folds_norm(w, proj, biased=biased, tuning=t)
                  for w, biased in nexts]
    down_at = tuple(i for i, layer in enumerate(params.layers)
                    if fuse and proj and f.digits and not cfg.is_moe(i) and not next_takes[i]
                    and project_digits(layer.w_gate_up, proj, swiglu=True, tuning=t)
                    and down_digits(layer.w_down, proj, t))
    layers = []
    for i, layer in enumerate(params.layers):
        common = dict(cfg=cfg, window=cfg.sliding_window if cfg.is_sliding(i) else None,
                      moe=cfg.is_moe(i), rope_scale=rope_scale[cfg.rope_of(i)], axis=axis, attention=attention,
                      route=route)
        if rows_mode:  # every matrix through rows_project; o's output with the residual via add_norm
            layers.append(LayerPlan(
                **common, projection=Projection("rows", rows_mode, t),
                add_norm=add_norm_mode(params.dtype, t), split_out=False, ffn_kernel=f.gate_kernel,
                ffn_norm_folded=False, ffn_digits=False, down_digits=False,
                next_folds=f.fold_residual, next_digits=False))
            continue
        moe = cfg.is_moe(i)
        next_w, next_bias = nexts[i]
        ffn_kernel = (bool(proj) and not moe and f.gate_kernel
                      and project_supports(layer.w_gate_up, True, tuning=t))
        ahead = [bool(proj) and prefetched(w, t) for w in (layer.wo, None if moe else layer.w_gate_up,
                                                            None if moe else layer.w_down, next_w)]
        layers.append(LayerPlan(
            **common, projection=Projection("project" if proj else None, proj, t), add_norm=fuse,
            split_out=proj is not None, ffn_kernel=ffn_kernel,
            ffn_norm_folded=ffn_kernel and f.fold_norms and f.fold_residual
            and project_folds_norm(layer.w_gate_up, proj, swiglu=True, tuning=t),
            ffn_digits=ffn_kernel and f.digits
            and project_digits(layer.w_gate_up, proj, swiglu=True, tuning=t),
            down_digits=i in down_at, next_folds=ffn_kernel and f.fold_residual and next_takes[i],
            # a one-token prefill (fresh) keeps a plain normed row, which it reorders with x
            next_digits=proj is not None and not fresh and project_digits(next_w, proj, biased=next_bias, tuning=t),
            prefetch=tuple(ahead),
            gate_up_wide=None if moe or not proj else t.gate_up_wide and not prefetched(layer.w_gate_up, t),
            weights_first=bool(proj) and weights_first((layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down), t)))
    return StepPlan(layers=tuple(layers), head=Projection("project" if proj else None, proj, t),
                    attention=attention, down_layers=down_at, tuning=t, axis=axis)


def describe(plan: StepPlan) -> dict[str, str]:
    """Which path each part of a step takes, for reports (bench's JSON): per matrix ("qkv", "o",
    "gate_up", "down", "lm_head") "project" (one-row kernel), "rows" (rows kernel) or "xla"; the
    attention, add+norm pairs and MoE routing "kernel" or "xla". Where layers differ, their paths
    joined by "/" in layer order (e.g. "kernel/xla"). Where the tuning puts kernel families the step
    takes on Mosaic GPU rather than Triton, "mosaic_gpu" names them (e.g. "add_norm,project");
    their calls the Mosaic GPU form does not take (`mosaic_supports`) stay on Triton."""
    def joined(values):
        return "/".join(dict.fromkeys(values))
    layers = plan.layers
    matrix = lambda lp: lp.projection.family or "xla"
    paths = {
        "qkv": joined(matrix(lp) for lp in layers),
        "attention": joined("kernel" if lp.attention else "xla" for lp in layers),
        "o": joined(matrix(lp) for lp in layers),
        "add_norm": joined("kernel" if lp.add_norm else "xla" for lp in layers),
        "gate_up": joined(matrix(lp) if lp.ffn_kernel else "xla" for lp in layers),
        "down": joined(matrix(lp) if lp.ffn_kernel else "xla" for lp in layers),
        "lm_head": plan.head.family or "xla",
    }
    if any(lp.moe for lp in layers):
        paths["route"] = joined("kernel" if lp.route else "xla" for lp in layers if lp.moe)
    taken = {"add_norm": "kernel" in paths["add_norm"].split("/"),
             "project": any("project" in paths[m].split("/") for m in ("qkv", "o", "gate_up", "down", "lm_head"))}
    mosaic = [f for f, on in taken.items() if on and getattr(plan.tuning, f"{f}_backend") == "mosaic_gpu"]
    if mosaic:
        paths["mosaic_gpu"] = ",".join(mosaic)
    return paths
