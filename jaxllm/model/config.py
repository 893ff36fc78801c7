"""The model configuration: one frozen, hashable dataclass for every supported family.

Family differences are explicit fields (`qkv_bias`, `qk_norm`, `sliding_window`, `num_experts`,
rope scaling); jaxllm.families maps each family's Hugging Face `config.json` onto them. The config is a
static jit argument and the static metadata of `Params`, so it must stay hashable.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from jaxllm.checks import FLOAT32_MAX, INT32_MAX, finite, flag, whole

# The model types jaxllm.families knows (one Family each). Anything else is refused by name.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "gemma2", "gemma3_text")
# Far past any published model (126 layers, 512 experts): a damaged count is refused before a
# name or flag is made for each layer or expert, which would take minutes or all the memory.
MAX_LAYERS = 4096
MAX_EXPERTS = 4096
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
# The MLP gate's activation: SwiGLU's silu, or GeGLU's GELU (Gemma: tanh-approximated).
ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
# Tokens that end a turn in the chat formats in use; one counts as a stop token when the model's
# template writes it (llama.cpp keeps a similar list for its end-of-generation set).
END_OF_TURN_TOKENS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|end_of_text|>", "<|return|>", "<|END_OF_TURN_TOKEN|>", "<｜end▁of▁sentence｜>",
    "<end_of_utterance>", "</s>",
)


def _fix(obj, name: str, value):
    """Set a field of a frozen dataclass in its __post_init__ (a checked value, normalized)."""
    object.__setattr__(obj, name, value)


def _rope_key(name: str) -> str:
    return "rope_theta" if name == "theta" else f"rope {name}"


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (HF `rope_parameters` / older `rope_theta` + `rope_scaling`)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    partial_rotary_factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    attention_factor: float | None = None  # yarn
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope type {self.rope_type!r}; supported: {ROPE_TYPES}")
        for name in ("theta", "factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
            _fix(self, name, finite(_rope_key(name), getattr(self, name), above=0.0))
        for name, above in (("attention_factor", 0.0), ("mscale", None), ("mscale_all_dim", None)):
            if getattr(self, name) is not None:
                _fix(self, name, finite(_rope_key(name), getattr(self, name), above=above))
        _fix(self, "partial_rotary_factor",
             finite("partial_rotary_factor", self.partial_rotary_factor, above=0.0, most=1.0))
        if self.original_max_position_embeddings is not None:
            _fix(self, "original_max_position_embeddings", whole(
                "rope original_max_position_embeddings", self.original_max_position_embeddings, 1))
        flag("rope truncate", self.truncate)
        if self.rope_type == "llama3":  # the smoothing ramp divides by high - low
            if self.original_max_position_embeddings is None:
                raise ValueError("llama3 rope needs original_max_position_embeddings")
            if self.high_freq_factor <= self.low_freq_factor:
                raise ValueError(f"llama3 rope needs high_freq_factor > low_freq_factor, not "
                                 f"{self.high_freq_factor} and {self.low_freq_factor}")
        if self.rope_type == "yarn" and self.theta == 1.0:  # yarn's ramp divides by log(theta)
            raise ValueError("yarn rope needs rope_theta != 1")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and family switches of a decoder-only transformer (dimension letters in comments)."""

    model_type: str
    vocab_size: int  # V
    hidden_size: int  # D
    num_layers: int  # L
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    ffn_size: int  # F of a dense MLP
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2; Llama's attention_bias also sets o_bias
    o_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over H of each q and k head, before RoPE
    sliding_window: int | None = None  # a key is seen while q_pos - k_pos < sliding_window
    sliding_layers: tuple[bool, ...] = ()  # per layer: does the window apply (empty: no layer)
    local_rope: RopeConfig | None = None  # the rope of the sliding layers where it differs (Gemma 3)
    # Gemma 2/3 (jaxllm.families.gemma reads them from config.json)
    norm_offset: float = 0.0  # every RMSNorm scales by (norm_offset + w), 0 or 1 (Gemma), in float32
    activation: str = "silu"  # of the MLP's gate (one of ACTIVATIONS)
    post_norms: bool = False  # the attention's and the MLP's outputs RMSNormed before their residual add
    embed_scale: bool = False  # embeddings times sqrt(D), that factor rounded to the dtype first
    query_pre_attn_scalar: float | None = None  # attention scores times its -1/2 power (None: head_dim's)
    attn_logit_softcap: float | None = None  # attention scores s -> tanh(s / c) * c
    final_logit_softcap: float | None = None  # logits the same
    # Mixture of experts (Mixtral, Qwen3-MoE); num_experts == 0 means a dense model.
    num_experts: int = 0  # E
    experts_per_token: int = 0  # A
    moe_ffn_size: int = 0  # F of one expert
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] = ()  # per layer: sparse (True) or dense MLP
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self):
        """Every field checked (and whole floats made ints): a config from any source, a
        converted checkpoint's jaxllm_config.json included, fails here by name, not later as a NaN."""
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unknown architecture: model_type {self.model_type!r}; "
                             f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "max_position_embeddings"):
            _fix(self, name, whole(name, getattr(self, name), 1, MAX_LAYERS if name == "num_layers" else INT32_MAX))
        for name in ("ffn_size", "num_experts", "experts_per_token", "moe_ffn_size"):
            _fix(self, name, whole(name, getattr(self, name), 0, MAX_EXPERTS if name == "num_experts" else INT32_MAX))
        _fix(self, "rms_norm_eps", finite("rms_norm_eps", self.rms_norm_eps, least=0.0, most=FLOAT32_MAX))
        if self.sliding_window is not None:
            _fix(self, "sliding_window", whole("sliding_window", self.sliding_window, 1))
        for name in ("tie_word_embeddings", "qkv_bias", "o_bias", "qk_norm", "norm_topk_prob", "post_norms",
                     "embed_scale"):
            flag(name, getattr(self, name))
        _fix(self, "norm_offset", finite("norm_offset", self.norm_offset))
        if self.norm_offset not in (0.0, 1.0):  # a weight's neutral value is then 1 or 0
            raise ValueError(f"norm_offset must be 0 or 1, not {self.norm_offset}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {self.activation!r}; supported: {', '.join(ACTIVATIONS)}")
        for name in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap"):
            if getattr(self, name) is not None:
                _fix(self, name, finite(name, getattr(self, name), above=0.0, most=FLOAT32_MAX))
        for name in ("sliding_layers", "moe_layers"):  # longer is fine (a preset cut to fewer layers)
            flags = getattr(self, name)
            if not (isinstance(flags, tuple) and all(isinstance(f, bool) for f in flags)
                    and (not flags or len(flags) >= self.num_layers)):
                raise ValueError(f"{name} must be empty or one bool per layer "
                                 f"({self.num_layers} layers), not {flags!r}")
        for name in ("bos_token_id", "pad_token_id"):
            if getattr(self, name) is not None:
                _fix(self, name, whole(name, getattr(self, name)))
        if not isinstance(self.eos_token_ids, tuple):
            raise ValueError(f"eos_token_ids must be a tuple of ints, not {self.eos_token_ids!r}")
        _fix(self, "eos_token_ids", tuple(whole("eos_token_ids", e) for e in self.eos_token_ids))
        if not isinstance(self.rope, RopeConfig):
            raise ValueError(f"rope must be a RopeConfig, not {self.rope!r}")
        if self.local_rope is not None and not isinstance(self.local_rope, RopeConfig):
            raise ValueError(f"local_rope must be a RopeConfig or None, not {self.local_rope!r}")
        for rope in self.ropes:
            if int(self.head_dim * rope.partial_rotary_factor) < 2:
                raise ValueError(f"partial_rotary_factor {rope.partial_rotary_factor} of head_dim "
                                 f"{self.head_dim} leaves no pair of channels to rotate")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.experts_per_token} must be between 1 and "
                             f"the expert count {self.num_experts}")
        for rope in self.ropes:
            _check_rope(self, rope)

    @property
    def q_per_kv(self) -> int:  # G
        return self.num_heads // self.num_kv_heads

    @property
    def pad_id(self) -> int:
        """The id written after a row has stopped: pad, else the first stop id, else 0."""
        if self.pad_token_id is not None:
            return self.pad_token_id
        return self.eos_token_ids[0] if self.eos_token_ids else 0

    def is_sliding(self, layer: int) -> bool:
        return self.sliding_window is not None and bool(self.sliding_layers) and self.sliding_layers[layer]

    def is_moe(self, layer: int) -> bool:
        return self.num_experts > 0 and bool(self.moe_layers) and self.moe_layers[layer]

    def rope_of(self, layer: int) -> RopeConfig:
        """The rope of a layer: `local_rope` for a sliding one where the model has one."""
        local = self.local_rope is not None and bool(self.sliding_layers) and self.sliding_layers[layer]
        return self.local_rope if local else self.rope

    @property
    def ropes(self) -> tuple[RopeConfig, ...]:
        """The model's distinct ropes: one, or the global and the local one."""
        return (self.rope,) if self.local_rope in (None, self.rope) else (self.rope, self.local_rope)

    @property
    def attn_scale(self) -> float:
        """What the attention scores are multiplied by, as transformers computes it (a Python float)."""
        return (self.head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar) ** -0.5


def read_json_object(path: Path) -> dict:
    """A JSON file whose top level is an object, else a ValueError naming the file."""
    if not path.is_file():  # a directory or a FIFO (which would block the read) is refused unopened
        raise ValueError(f"{path} is not a regular file")
    try:
        d = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: not UTF-8 ({e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path} is malformed: its top level is {type(d).__name__}, not an object")
    return d


def rope_frequencies(config: ModelConfig, seq_len: int | None = None,
                     rope: RopeConfig | None = None) -> tuple[np.ndarray, float]:
    """Inverse frequencies [H_rot/2] (float32) and the cos/sin scale, as transformers computes them,
    of `rope` (default: the config's global one; `config.rope_of(layer)` gives a layer's).

    `seq_len` matters only for "dynamic" NTK scaling, which stretches the base once the sequence
    outgrows max_position_embeddings. The model passes none: jaxllm's sequences stay within the
    context, where transformers uses the plain base too.
    """
    r = config.rope if rope is None else rope
    dim = int(config.head_dim * r.partial_rotary_factor)
    # float32 throughout, like torch: angles built in lower precision collapse at long positions.
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    base = r.theta
    scale = 1.0
    if r.rope_type == "dynamic" and seq_len is not None and seq_len > config.max_position_embeddings:
        base = base * ((r.factor * seq_len / config.max_position_embeddings) - (r.factor - 1)) ** (
            dim / (dim - 2))
    inv_freq = (1.0 / (np.float32(base) ** exponents)).astype(np.float32)
    if r.rope_type == "linear":
        inv_freq = inv_freq / np.float32(r.factor)
    elif r.rope_type == "llama3":
        old_len = r.original_max_position_embeddings
        low_wavelen = old_len / r.low_freq_factor
        high_wavelen = old_len / r.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / r.factor, inv_freq)
        smooth = (old_len / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
        smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled).astype(np.float32)
    elif r.rope_type == "yarn":
        inv_freq, scale = _yarn(r, dim, config.max_position_embeddings)
    return inv_freq.astype(np.float32), float(scale)


def _check_rope(config: ModelConfig, r: RopeConfig) -> None:
    """The rope parameters must give float32 frequencies and a scale that are finite numbers: each
    is checked alone, but together (theta 1e-50, a factor of 1e-50, attention_factor 1e39) they
    overflow, and the logits would be NaN."""
    try:
        with np.errstate(all="ignore"):
            inv_freq, scale = rope_frequencies(config, rope=r)
            finite = bool(np.isfinite(inv_freq).all()) and math.isfinite(scale) and scale > 0 \
                and math.isfinite(float(np.float32(scale)))
    except (ArithmeticError, ValueError) as e:  # math.log of 0, a division by zero, an overflow
        finite, problem = False, f" ({type(e).__name__}: {e})"
    else:
        problem = ""
    if not finite:
        raise ValueError(f"{r.rope_type} rope with rope_theta {r.theta}, factor {r.factor} (and its other "
                         f"parameters) gives frequencies or a scale that float32 cannot hold{problem}")


def _yarn(r: RopeConfig, dim: int, max_pos: int) -> tuple[np.ndarray, float]:
    original = r.original_max_position_embeddings or max_pos
    factor = r.factor

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if r.attention_factor is not None:
        attention_factor = float(r.attention_factor)
    elif r.mscale and r.mscale_all_dim:
        attention_factor = get_mscale(factor, r.mscale) / get_mscale(factor, r.mscale_all_dim)
    else:
        attention_factor = get_mscale(factor)

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(r.theta))

    low, high = correction_dim(r.beta_fast), correction_dim(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp
    pos_freqs = np.float32(r.theta) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq.astype(np.float32), attention_factor
