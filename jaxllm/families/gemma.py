"""The Gemma family: Gemma 2 (`gemma2`) and Gemma 3 text (`gemma3_text`, and the `gemma3`
multimodal configs whose text_config is one), from config.json or a llama.cpp GGUF file.

What differs from Llama, as `ModelConfig` switches: (1 + w) RMSNorms computed in float32
(`norm_offset`), GeGLU with tanh GELU (`activation`), norms of the attention's and the MLP's
outputs (`post_norms`), embeddings times sqrt(D) (`embed_scale`), attention scaled by
query_pre_attn_scalar^-1/2; Gemma 2 soft-caps the attention scores and the logits and slides its
window on every other layer; Gemma 3 norms q and k per head and slides on 5 of 6 layers, which
rotate with their own base (`local_rope`, rope_local_base_freq) while the global layers take
rope_theta and the rope scaling.

Published Gemma 3 configs leave many keys to transformers' defaults (a multimodal checkpoint's
text_config names five or six): `DEFAULTS` holds transformers' values for the keys read here.
"""

from __future__ import annotations

from jaxllm.checks import whole
from jaxllm.model.config import MAX_LAYERS, ModelConfig

_LAYER = "model.layers.{i}."


def names(llama_names: dict[str, str]) -> dict[str, str]:
    """Gemma's tensor names: Llama's, but post_attention_layernorm norms the attention's output and
    the MLP has its own pre- and post-norms."""
    return {**llama_names,
            "mlp_norm": _LAYER + "pre_feedforward_layernorm.weight",
            "post_attn_norm": _LAYER + "post_attention_layernorm.weight",
            "post_mlp_norm": _LAYER + "post_feedforward_layernorm.weight"}


# transformers' Gemma2Config / Gemma3TextConfig defaults of every key the readers take.
_COMMON = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_size=2304,
               intermediate_size=9216, num_hidden_layers=26, hidden_activation="gelu_pytorch_tanh",
               rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1, bos_token_id=2,
               tie_word_embeddings=True, attention_bias=False, query_pre_attn_scalar=256,
               sliding_window=4096)
DEFAULTS = {
    "gemma2": dict(_COMMON, vocab_size=256000, max_position_embeddings=8192, rope_theta=10000.0,
                   final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    "gemma3_text": dict(_COMMON, vocab_size=262208, max_position_embeddings=131072, rope_theta=1_000_000.0,
                        rope_local_base_freq=10_000.0, final_logit_softcapping=None,
                        attn_logit_softcapping=None),
}
# The period of the sliding layers where a config has no layer_types: every 2nd layer of Gemma 2
# and every 6th of Gemma 3 (transformers' default sliding_window_pattern) sees everything.
_PERIOD = {"gemma2": 2, "gemma3_text": 6}
# hidden_activation -> ModelConfig.activation
_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}

# Multimodal configs that hold a Gemma text model: model_type -> the text_config's model_type.
WRAPPERS = {"gemma3": "gemma3_text"}


def unwrap(c: dict) -> dict:
    """A `gemma3` (multimodal) config.json's text model config: its text_config, with the
    wrapper's token ids where it states them and its tie_word_embeddings. Any other config comes
    back as it is."""
    if c.get("model_type") not in WRAPPERS:
        return c
    text = c.get("text_config")
    if text is None:
        text = {}
    if not isinstance(text, dict):
        raise ValueError(f"text_config must be an object, not {text!r:.80}")
    text_type = WRAPPERS[c["model_type"]]
    if text.get("model_type", text_type) != text_type:
        raise ValueError(f"a {c['model_type']!r} config's text_config must be of model_type "
                         f"{text_type!r}, not {text.get('model_type')!r}")
    ids = {k: c[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if c.get(k) is not None}
    # The wrapper's tie_word_embeddings decides (transformers ties by the model's own config): True
    # unless it says otherwise
    tie = c.get("tie_word_embeddings")
    return {**text, **ids, "model_type": text_type, "tie_word_embeddings": True if tie is None else tie}


def with_defaults(c: dict) -> dict:
    """`c` with transformers' default for each key it lacks (or holds null where transformers'
    default is not), and layer_types where it has none."""
    model_type = c["model_type"]
    out = dict(c)
    for key, value in DEFAULTS[model_type].items():
        if out.get(key) is None and not (key in out and key.endswith("softcapping")):
            out[key] = value
    if not out.get("layer_types"):
        layers = whole("num_hidden_layers", out["num_hidden_layers"], 1, MAX_LAYERS)
        period = _PERIOD[model_type]
        if model_type == "gemma3_text" and out.get("sliding_window_pattern") is not None:
            period = whole("sliding_window_pattern", out["sliding_window_pattern"], 1)
        out["layer_types"] = ["sliding_attention" if (i + 1) % period else "full_attention"
                              for i in range(layers)]
    return out


def read(c: dict, num_layers: int, rope_from_hf) -> dict:
    """The ModelConfig switches of a Gemma config.json `c` (defaults filled in), by name;
    `rope_from_hf` reads a rope from a config dict (hf_config's reader)."""
    if c.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=True (an embedding model) is not a causal "
                         "language model jaxllm can generate with")
    act = c.get("hidden_activation")
    if act not in _ACTIVATIONS:
        raise ValueError(f"unsupported hidden_activation {act!r}; supported: {', '.join(_ACTIVATIONS)}")
    layer_types = c["layer_types"]
    if not (isinstance(layer_types, list) and len(layer_types) == num_layers
            and all(t in ("sliding_attention", "full_attention") for t in layer_types)):
        raise ValueError(f"layer_types must list 'sliding_attention' or 'full_attention' for each of "
                         f"the {num_layers} layers, not {layer_types!r:.200}")
    switches = dict(norm_offset=1.0, activation=_ACTIVATIONS[act], post_norms=True, embed_scale=True,
                    query_pre_attn_scalar=c["query_pre_attn_scalar"],
                    attn_logit_softcap=c.get("attn_logit_softcapping"),
                    final_logit_softcap=c.get("final_logit_softcapping"),
                    sliding_layers=tuple(t == "sliding_attention" for t in layer_types),
                    qk_norm=c["model_type"] == "gemma3_text")
    if c["model_type"] == "gemma3_text":
        switches.update(_gemma3_ropes(c, rope_from_hf))
    return switches


def _gemma3_ropes(c: dict, rope_from_hf) -> dict:
    """Gemma 3's two ropes: transformers 5 writes them as rope_parameters per layer type, older
    configs as rope_theta + rope_scaling (global layers) and rope_local_base_freq (local ones)."""
    params = c.get("rope_parameters")
    plain = {k: v for k, v in c.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        full, local = params.get("full_attention"), params.get("sliding_attention")
        for name, p in (("full_attention", full), ("sliding_attention", local)):
            if not isinstance(p, dict):
                raise ValueError(f"rope_parameters[{name!r}] must be an object, not {p!r:.80}")
        default = DEFAULTS["gemma3_text"]
        full = {"rope_theta": default["rope_theta"], **full}
        local = {"rope_theta": default["rope_local_base_freq"], **local}
        return dict(rope=rope_from_hf({**plain, "rope_parameters": full}),
                    local_rope=rope_from_hf({**plain, "rope_parameters": local}))
    local = {"rope_type": "default", "rope_theta": c["rope_local_base_freq"]}
    return dict(local_rope=rope_from_hf({**plain, "rope_parameters": local}))


def write(cfg: ModelConfig, rope_to_hf) -> dict:
    """The Gemma keys of `cfg`'s config.json (`rope_to_hf` writes a rope's rope_parameters)."""
    if not (cfg.norm_offset == 1.0 and cfg.post_norms and cfg.embed_scale
            and cfg.qk_norm == (cfg.model_type == "gemma3_text")):
        raise ValueError(f"a {cfg.model_type} config has (1 + w) norms, post-norms, scaled embeddings "
                         f"and {'' if cfg.model_type == 'gemma3_text' else 'no '}q/k norms")
    act = {v: k for k, v in _ACTIVATIONS.items()}[cfg.activation]
    scalar = cfg.query_pre_attn_scalar or cfg.head_dim
    c = dict(hidden_activation=act, hidden_act=act,  # transformers' config declares an int
             query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
             attn_logit_softcapping=cfg.attn_logit_softcap,
             final_logit_softcapping=cfg.final_logit_softcap,
             sliding_window=cfg.sliding_window,
             layer_types=["sliding_attention" if cfg.sliding_layers and cfg.sliding_layers[i]
                          else "full_attention" for i in range(cfg.num_layers)])
    if cfg.model_type == "gemma3_text":
        local = cfg.local_rope or cfg.rope
        c["rope_parameters"] = {"full_attention": rope_to_hf(cfg.rope),
                                "sliding_attention": rope_to_hf(local)}
    return c


# --- GGUF (llama.cpp's converter: convert_hf_to_gguf.py, and llama-model.cpp's hparams) ----------

# llama.cpp's layer counts of the 27B models, whose attention scale it takes from D / N rather
# than the head size (the only Gemma 2/3 sizes where query_pre_attn_scalar is not head_dim).
_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def gguf_config(meta: dict, arch: str, config: dict, path) -> dict:
    """The Gemma keys of the config.json of a GGUF file of architecture `arch` ("gemma2" or
    "gemma3"), as llama.cpp reads the file: its sliding window (Gemma 2's default 4096), the soft
    caps (Gemma 2 only; absent keys take transformers' defaults), the sliding layers (a
    sliding_window_pattern key, else every 2nd / 6th layer full), Gemma 3's local rope base
    (rope.freq_base_swa, else 10000), and query_pre_attn_scalar by llama.cpp's rule."""
    prefix = arch + "."
    layers = config["num_hidden_layers"]
    out = {"hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh"}
    window = meta.get(prefix + "attention.sliding_window", 4096 if arch == "gemma2" else None)
    if window is None:
        raise ValueError(f"{path}: GGUF metadata lacks {prefix}attention.sliding_window")
    out["sliding_window"] = window
    if arch == "gemma2":
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if prefix + key in meta:
                out[key] = meta[prefix + key]
    else:
        out["attn_logit_softcapping"] = out["final_logit_softcapping"] = None
        out["rope_local_base_freq"] = meta.get(prefix + "rope.freq_base_swa", 10_000.0)
    pattern = meta.get(prefix + "attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
    if isinstance(pattern, list):  # per layer: does it slide
        if len(pattern) != layers or not all(isinstance(p, bool) for p in pattern):
            raise ValueError(f"{path}: GGUF metadata {prefix}attention.sliding_window_pattern must "
                             f"hold a bool for each of the {layers} layers")
        sliding = pattern
    else:  # llama.cpp's set_swa_pattern(n): layer i slides where i % n < n - 1
        n = whole(f"{prefix}attention.sliding_window_pattern", pattern, 0, MAX_LAYERS)
        sliding = [n == 0 or i % n < n - 1 for i in range(layers)]
    out["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    out["query_pre_attn_scalar"] = (config["hidden_size"] // config["num_attention_heads"]
                                    if layers == _27B_LAYERS[arch] else config["head_dim"])
    return out
