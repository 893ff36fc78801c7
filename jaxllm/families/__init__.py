"""The model families: a registry model_type -> `Family`, holding everything that differs per
family outside the model itself. A family says how its Hugging Face config.json maps onto
`ModelConfig`'s switches (and back), which HF tensor holds each parameter of the spec table
(model/params.py names them by role: "layers.3.q", "layers.3.experts.5.gate"), and how a GGUF
file of its architecture reads. The model sees only `ModelConfig`'s family-neutral switches.

Adding a family: its switches in model/config.py, a `Family` here with its HF keys and tensor
names (a module of its own where it has many, as families/gemma.py), its model_type in
`SUPPORTED_MODEL_TYPES`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from jaxllm.families import gemma, hf_config
from jaxllm.model.config import SUPPORTED_MODEL_TYPES, ModelConfig, read_json_object
from jaxllm.model.params import ParamSpec

# The HF tensor of each role, as Llama names them; the other families change a few.
_LAYER = "model.layers.{i}."
LLAMA_NAMES = {
    "embed": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "attn_norm": _LAYER + "input_layernorm.weight",
    "mlp_norm": _LAYER + "post_attention_layernorm.weight",
    **{x: _LAYER + f"self_attn.{x}_proj.weight" for x in "qkvo"},
    **{f"{x}_bias": _LAYER + f"self_attn.{x}_proj.bias" for x in "qkvo"},
    "q_norm": _LAYER + "self_attn.q_norm.weight",
    "k_norm": _LAYER + "self_attn.k_norm.weight",
    **{w: _LAYER + f"mlp.{w}_proj.weight" for w in ("gate", "up", "down")},
}
QWEN_MOE_NAMES = {
    **LLAMA_NAMES,
    "router": _LAYER + "mlp.gate.weight",
    **{f"expert_{w}": _LAYER + f"mlp.experts.{{e}}.{w}_proj.weight" for w in ("gate", "up", "down")},
}
MIXTRAL_NAMES = {
    **LLAMA_NAMES,
    "router": _LAYER + "block_sparse_moe.gate.weight",
    **{f"expert_{w}": _LAYER + f"block_sparse_moe.experts.{{e}}.{n}.weight"
       for w, n in (("gate", "w1"), ("up", "w3"), ("down", "w2"))},
}


@dataclasses.dataclass(frozen=True)
class Family:
    """What one model_type's checkpoints look like (see the module docstring)."""

    model_type: str
    architectures: tuple[str, ...]  # transformers' class names, written into a GGUF's config.json
    names: dict[str, str]  # role -> HF tensor name, with {i} the layer and {e} the expert
    # config.json -> ModelConfig switches
    window_always: bool = False  # sliding_window read without use_sliding_window (Mistral's rule)
    window_from_max_layers: bool = False  # no layer_types: sliding from max_window_layers on (Qwen2/3)
    qkv_bias: bool = False  # q/k/v biases whatever attention_bias says (Qwen2)
    bias_sets_o: bool = False  # attention_bias covers o_proj too (Llama, Mistral)
    qk_norm: bool = False  # Qwen3
    read_moe: Callable[[dict, int], hf_config.Moe] | None = None  # the expert keys; None: dense
    write_moe: Callable[[ModelConfig], dict] | None = None
    # GGUF: llama.cpp permutes Q/K rows for archs whose converter derives from LlamaModel; head_dim
    # comes from the first of head_dim_keys present (else hidden_size // num_attention_heads).
    permute_qk: bool = False
    head_dim_keys: tuple[str, ...] = ("attention.key_length",)
    gguf_moe: Callable[[dict, str, int, str], dict] | None = None  # expert keys of the config.json
    gguf_split_experts: bool = False  # early files wrote one tensor per expert (blk.{i}.ffn_gate.{e})
    # A family with switches of its own (Gemma): defaults for absent config keys, its switches
    # (ModelConfig fields, given the config, layer count and the rope reader), their config.json
    # keys (given the rope writer), and those keys from a GGUF file's metadata
    # (meta, architecture, the config so far, path).
    prepare: Callable[[dict], dict] | None = None
    read_extra: Callable[[dict, int, Callable], dict] | None = None
    write_extra: Callable[[ModelConfig, Callable], dict] | None = None
    gguf_extra: Callable[[dict, str, dict, object], dict] | None = None

    def tensor_name(self, key: str) -> str | None:
        """The HF name of a spec-table source key ("embed", "layers.3.q", "layers.3.experts.5.up");
        None where this family has no such tensor."""
        parts = key.split(".")
        if parts[0] != "layers":
            return self.names.get(key)
        if parts[2] == "experts":
            template = self.names.get("expert_" + parts[4])
            return template and template.format(i=parts[1], e=parts[3])
        template = self.names.get(parts[2])
        return template and template.format(i=parts[1])

    def hf_sources(self, spec: ParamSpec) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """(HF name, shape) of each source tensor of a parameter, in the table's order."""
        return tuple((self.tensor_name(key), shape) for key, shape in spec.sources)


_LLAMA_LIKE = dict(window_always=True, bias_sets_o=True, permute_qk=True,
                   head_dim_keys=("rope.dimension_count", "attention.key_length"))
_GEMMA = dict(window_always=True, bias_sets_o=True, prepare=gemma.with_defaults, read_extra=gemma.read,
              write_extra=gemma.write, gguf_extra=gemma.gguf_config)
FAMILIES = {f.model_type: f for f in (
    Family("llama", ("LlamaForCausalLM",), LLAMA_NAMES, **_LLAMA_LIKE),
    Family("mistral", ("MistralForCausalLM",), LLAMA_NAMES, **_LLAMA_LIKE),
    Family("qwen2", ("Qwen2ForCausalLM",), LLAMA_NAMES, window_from_max_layers=True, qkv_bias=True),
    Family("qwen3", ("Qwen3ForCausalLM",), LLAMA_NAMES, window_from_max_layers=True, qk_norm=True),
    Family("mixtral", ("MixtralForCausalLM",), MIXTRAL_NAMES, window_always=True, permute_qk=True,
           head_dim_keys=("rope.dimension_count", "attention.key_length"), read_moe=hf_config.mixtral_moe,
           write_moe=hf_config.mixtral_moe_keys, gguf_moe=hf_config.mixtral_gguf_moe, gguf_split_experts=True),
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",), QWEN_MOE_NAMES, qk_norm=True, read_moe=hf_config.qwen3_moe,
           write_moe=hf_config.qwen3_moe_keys, gguf_moe=hf_config.qwen3_gguf_moe),
    Family("gemma2", ("Gemma2ForCausalLM",), gemma.names(LLAMA_NAMES), **_GEMMA),
    Family("gemma3_text", ("Gemma3ForCausalLM",), gemma.names(LLAMA_NAMES), qk_norm=True, **_GEMMA),
)}
assert tuple(FAMILIES) == SUPPORTED_MODEL_TYPES, "ModelConfig refuses a model_type with no family"

# GGUF general.architecture -> family; a llama file with experts is Mixtral (llama.cpp converts
# Mixtral with the llama architecture).
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe",
                      "gemma2": "gemma2", "gemma3": "gemma3_text"}
GGUF_WITH_EXPERTS = {"llama": "mixtral"}


def family(model_type, architectures=...) -> Family:
    """The family of a model_type; a ValueError naming it (and the architectures) where none is."""
    if model_type not in FAMILIES:
        archs = "" if architectures is ... else f" (architectures {architectures})"
        raise ValueError(f"unknown architecture: model_type {model_type!r}{archs}; "
                         f"supported model types: {', '.join(FAMILIES)} "
                         f"(and the text model of {', '.join(gemma.WRAPPERS)})")
    return FAMILIES[model_type]


def gguf_family(architecture: str, experts: int, path) -> Family:
    """The family of a GGUF file's general.architecture (and expert count)."""
    if architecture not in GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {architecture!r} is not supported by jaxllm "
                         f"(supported: {', '.join(GGUF_ARCHITECTURES)})")
    if experts and architecture in GGUF_WITH_EXPERTS:
        return FAMILIES[GGUF_WITH_EXPERTS[architecture]]
    return FAMILIES[GGUF_ARCHITECTURES[architecture]]


def config_from_hf(source: str | Path | dict) -> ModelConfig:
    """Read a Hugging Face config.json (path, directory or parsed dict) as a ModelConfig."""
    if isinstance(source, dict):
        return _from_dict(source)
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise ValueError(f"{path} not found: a Hugging Face checkpoint needs config.json")
    c = read_json_object(path)
    try:
        return _from_dict(c)
    except ValueError as e:  # the one place a malformed config.json gets its file named
        raise ValueError(f"{path}: {e}") from None


def _from_dict(c: dict) -> ModelConfig:
    architectures = c.get("architectures")
    c = gemma.unwrap(c)  # a multimodal config: its text model
    return hf_config.from_hf_dict(c, family(c.get("model_type"), architectures))


def text_tensor_names(config: dict, names) -> dict[str, str] | None:
    """For a multimodal checkpoint (a `gemma3` config.json), the text model's tensors: HF text-model
    name -> the name stored, the vision tower's and projector's left out; None for any other
    checkpoint. The Hub's checkpoints (and save_pretrained's) store `language_model.model.layers...`,
    transformers 5's modules name them `model.language_model.layers...`; an untied lm_head is
    `language_model.lm_head` or `lm_head`."""
    if config.get("model_type") not in gemma.WRAPPERS:
        return None
    out = {}
    for name in names:
        for stored, text in (("language_model.model.", "model."), ("model.language_model.", "model."),
                             ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head.")):
            if name.startswith(stored):
                out[text + name[len(stored):]] = name
                break
    return out


def config_to_hf(cfg: ModelConfig) -> dict:
    """A Hugging Face config.json (as a dict) that `config_from_hf` reads back as this config and
    transformers loads as the same model (random checkpoints of a preset's shape)."""
    return hf_config.to_hf_dict(cfg, family(cfg.model_type))


def of(cfg: ModelConfig) -> Family:
    """The family of a config."""
    return family(cfg.model_type)
