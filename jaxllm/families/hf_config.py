"""Hugging Face config.json <-> ModelConfig, for every family: the keys all families share are
read here; what differs (sliding-window rules, biases, the expert keys) comes from the family.
"""

from __future__ import annotations

from typing import NamedTuple

from jaxllm.checks import FLOAT32_MAX, INT32_MAX, finite, flag, whole
from jaxllm.model.config import MAX_EXPERTS, MAX_LAYERS, ModelConfig, RopeConfig


class Moe(NamedTuple):
    """The expert switches of a config (all zero: a dense model)."""

    num_experts: int = 0
    per_token: int = 0
    ffn: int = 0
    layers: tuple[bool, ...] = ()
    norm_topk: bool = True


_REQUIRED = object()


def _int(c: dict, key: str, default=_REQUIRED, least: int | None = 1, most: int = INT32_MAX) -> int:
    """config key `key` as an int in [least, most]; absent or null: `default` (no default: an error)."""
    value = c.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ValueError(f"config.json lacks required key {key!r}")
        return default
    return whole(key, value, least, most)


def _float(c: dict, key: str, default: float, **bounds) -> float:
    value = c.get(key)
    return default if value is None else finite(key, value, **bounds)


def _bool(c: dict, key: str, default: bool) -> bool:
    value = c.get(key)
    return default if value is None else flag(key, value)


def _int_list(c: dict, key: str, least: int | None = None) -> list[int]:
    """An int or a list of ints (e.g. eos_token_id), as a list; absent or null: []."""
    value = c.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        value = [value]
    return [whole(key, v, least) for v in value]


def from_hf_dict(c: dict, family) -> ModelConfig:
    """The ModelConfig of a config.json dict of `family` (a jaxllm.families.Family)."""
    if family.prepare:  # the family's defaults for absent keys
        c = family.prepare(c)
    num_layers = _int(c, "num_hidden_layers", most=MAX_LAYERS)  # before any per-layer tuple is made
    num_heads = _int(c, "num_attention_heads")
    hidden = _int(c, "hidden_size")
    num_kv = _int(c, "num_key_value_heads", num_heads)
    head_dim = _int(c, "head_dim", hidden // num_heads)
    # The family's own switches (Gemma's), which may replace the ones read below
    extra = family.read_extra(c, num_layers, _rope_from_hf) if family.read_extra else {}
    if "activation" not in extra and c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {c.get('hidden_act')!r}: only silu is implemented")
    if _bool(c, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported")

    # Sliding windows: Mistral slides on every layer when sliding_window is set; Qwen2/3 only with
    # use_sliding_window, on the layers listed in layer_types (or from max_window_layers on);
    # Qwen3-MoE with use_sliding_window on every layer (transformers reads no max_window_layers for it).
    window = None
    sliding_layers: tuple[bool, ...] = ()
    if family.window_always or _bool(c, "use_sliding_window", False):
        window = _int(c, "sliding_window", None)
    if window is not None:
        layer_types = c.get("layer_types")
        if layer_types:
            if not (isinstance(layer_types, list) and len(layer_types) == num_layers
                    and all(t in ("sliding_attention", "full_attention") for t in layer_types)):
                raise ValueError(f"layer_types must list 'sliding_attention' or 'full_attention' for "
                                 f"each of the {num_layers} layers, not {layer_types!r}")
            sliding_layers = tuple(t == "sliding_attention" for t in layer_types)
        elif family.window_from_max_layers:
            first = _int(c, "max_window_layers", num_layers, least=0)
            sliding_layers = tuple(i >= first for i in range(num_layers))
        else:
            sliding_layers = (True,) * num_layers

    # Absent expert keys take transformers' config defaults
    moe = family.read_moe(c, num_layers) if family.read_moe else Moe()

    attention_bias = _bool(c, "attention_bias", False)
    bos = _int_list(c, "bos_token_id")
    pad = _int_list(c, "pad_token_id")
    if len(bos) > 1 or len(pad) > 1:
        raise ValueError(f"bos_token_id and pad_token_id must be one integer each, not "
                         f"{c.get('bos_token_id')!r} and {c.get('pad_token_id')!r}")
    fields = dict(
        model_type=family.model_type,
        vocab_size=_int(c, "vocab_size"),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        ffn_size=_int(c, "intermediate_size", 0, least=0),
        max_position_embeddings=_int(c, "max_position_embeddings", 2048),
        rms_norm_eps=_float(c, "rms_norm_eps", 1e-6, least=0.0, most=FLOAT32_MAX),
        rope=_rope_from_hf(c),
        tie_word_embeddings=_bool(c, "tie_word_embeddings", False),
        qkv_bias=family.qkv_bias or attention_bias,
        o_bias=family.bias_sets_o and attention_bias,
        qk_norm=family.qk_norm,
        sliding_window=window,
        sliding_layers=sliding_layers,
        num_experts=moe.num_experts,
        experts_per_token=moe.per_token,
        moe_ffn_size=moe.ffn,
        norm_topk_prob=moe.norm_topk,
        moe_layers=moe.layers,
        bos_token_id=bos[0] if bos else None,
        eos_token_ids=tuple(_int_list(c, "eos_token_id")),
        pad_token_id=pad[0] if pad else None,
    )
    return ModelConfig(**{**fields, **extra})


def _rope_from_hf(c: dict) -> RopeConfig:
    """Reads transformers 5's `rope_parameters` and the older `rope_theta` + `rope_scaling`."""
    params = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters/rope_scaling must be an object, not {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))  # RopeConfig checks it
    # a key inside rope_parameters wins over the same key at the top level
    merged = {**c, **params}
    original = _int(merged, "original_max_position_embeddings", None)
    if rope_type in ("llama3", "yarn") and original is None:
        original = _int(c, "max_position_embeddings", None)
    factor = _float(params, "factor", None, above=0.0)
    if factor is None:  # transformers' yarn without a factor (DeepSeek-V3 style): the context ratio
        factor = _int(c, "max_position_embeddings", original) / original if rope_type == "yarn" and original else 1.0
    optional = {k: _float(params, k, None) for k in ("attention_factor", "mscale", "mscale_all_dim")}
    return RopeConfig(
        theta=_float(merged, "rope_theta", 10000.0),
        rope_type=rope_type,
        factor=factor,
        partial_rotary_factor=_float(merged, "partial_rotary_factor", 1.0),
        original_max_position_embeddings=original,
        low_freq_factor=_float(params, "low_freq_factor", 1.0),
        high_freq_factor=_float(params, "high_freq_factor", 4.0),
        beta_fast=_float(params, "beta_fast", 32.0),
        beta_slow=_float(params, "beta_slow", 1.0),
        truncate=_bool(params, "truncate", True),
        **optional,
    )


def _rope_to_hf(r: RopeConfig) -> dict:
    """A rope as transformers 5's rope_parameters."""
    rope = {"rope_type": r.rope_type, "rope_theta": r.theta}
    if r.rope_type != "default":
        rope["factor"] = r.factor
    if r.original_max_position_embeddings is not None:
        rope["original_max_position_embeddings"] = r.original_max_position_embeddings
    if r.rope_type == "llama3":
        rope.update(low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor)
    if r.rope_type == "yarn":
        rope.update(attention_factor=r.attention_factor, beta_fast=r.beta_fast,
                    beta_slow=r.beta_slow, mscale=r.mscale, mscale_all_dim=r.mscale_all_dim,
                    truncate=r.truncate)
    return rope


# The switches only a family with its own reader (Gemma) sets, at their plain values.
_PLAIN = dict(local_rope=None, norm_offset=0.0, activation="silu", post_norms=False, embed_scale=False,
              query_pre_attn_scalar=None, attn_logit_softcap=None, final_logit_softcap=None)


def to_hf_dict(cfg: ModelConfig, family) -> dict:
    """The config.json dict of `cfg`, a config of `family`."""
    r = cfg.rope
    if family.write_extra is None:
        set_ = [k for k, v in _PLAIN.items() if getattr(cfg, k) != v]
        if set_:
            raise ValueError(f"a {cfg.model_type} config.json has no {', '.join(set_)}")
    c = dict(model_type=cfg.model_type, hidden_act="silu", vocab_size=cfg.vocab_size,
             hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
             num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
             head_dim=cfg.head_dim, intermediate_size=cfg.ffn_size,
             max_position_embeddings=cfg.max_position_embeddings,
             rms_norm_eps=cfg.rms_norm_eps, rope_theta=r.theta, rope_parameters=_rope_to_hf(r),
             partial_rotary_factor=r.partial_rotary_factor,
             tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=cfg.bos_token_id,
             eos_token_id=list(cfg.eos_token_ids), pad_token_id=cfg.pad_token_id)
    if family.bias_sets_o:
        if cfg.qkv_bias != cfg.o_bias:
            raise ValueError(f"{cfg.model_type} has one attention_bias for q/k/v and o")
        c["attention_bias"] = cfg.qkv_bias
    elif cfg.qkv_bias != family.qkv_bias or cfg.o_bias:
        raise ValueError(f"{cfg.model_type} cannot have qkv_bias={cfg.qkv_bias}, "
                         f"o_bias={cfg.o_bias}")
    c["sliding_window"] = cfg.sliding_window  # null, not absent: Mistral's default is 4096
    if cfg.sliding_window is not None:
        c["use_sliding_window"] = True
        c["layer_types"] = ["sliding_attention" if cfg.is_sliding(i) else "full_attention"
                            for i in range(cfg.num_layers)]
    if family.write_moe:
        c.update(family.write_moe(cfg))
    if family.write_extra:
        c.update(family.write_extra(cfg, _rope_to_hf))
    return c


def mixtral_moe(c: dict, num_layers: int) -> Moe:
    # Mixtral's router always renormalizes its top-k; it has no such key
    return Moe(_int(c, "num_local_experts", 8, most=MAX_EXPERTS), _int(c, "num_experts_per_tok", 2),
               _int(c, "intermediate_size"), (True,) * num_layers, True)


def qwen3_moe(c: dict, num_layers: int) -> Moe:
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts (an attribute_map
    # alias); published checkpoints spell it num_experts.
    experts_key = "num_experts" if c.get("num_experts") is not None else "num_local_experts"
    num_experts = _int(c, experts_key, 128, least=0, most=MAX_EXPERTS)
    per_token = _int(c, "num_experts_per_tok", 8)
    moe_ffn = _int(c, "moe_intermediate_size", 768)
    norm_topk = _bool(c, "norm_topk_prob", False)
    step = _int(c, "decoder_sparse_step", 1)
    dense = c.get("mlp_only_layers") or []
    if not isinstance(dense, list):
        raise ValueError(f"mlp_only_layers must be a list of layer numbers, not {dense!r}")
    dense = {whole("mlp_only_layers", i, 0) for i in dense}
    layers = tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
    return Moe(num_experts, per_token, moe_ffn, layers, norm_topk)


def mixtral_moe_keys(cfg: ModelConfig) -> dict:
    # the dense intermediate_size, which no layer uses, is the experts' F, as transformers has it
    return dict(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                intermediate_size=cfg.moe_ffn_size)


def qwen3_moe_keys(cfg: ModelConfig) -> dict:
    return dict(num_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                moe_intermediate_size=cfg.moe_ffn_size, norm_topk_prob=cfg.norm_topk_prob,
                decoder_sparse_step=1, mlp_only_layers=[i for i in range(cfg.num_layers) if not cfg.is_moe(i)])


def mixtral_gguf_moe(meta: dict, prefix: str, experts: int, path) -> dict:
    # Mixtral's intermediate_size (feed_forward_length) is the width of one expert
    return dict(num_local_experts=experts, num_experts_per_tok=meta[prefix + "expert_used_count"])


def qwen3_gguf_moe(meta: dict, prefix: str, experts: int, path) -> dict:
    ffn = meta.get(prefix + "expert_feed_forward_length")
    if ffn is None:
        raise ValueError(f"{path}: GGUF metadata lacks {prefix}expert_feed_forward_length")
    # llama.cpp's qwen3moe always renormalizes the top-k weights (transformers' GGUF default too)
    return dict(num_experts=experts, num_experts_per_tok=meta[prefix + "expert_used_count"],
                moe_intermediate_size=ffn, norm_topk_prob=True)
