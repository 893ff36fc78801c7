"""Choosing the next token from logits: greedy, or temperature with top-k / top-p / min-p filters.

The order and the meaning of each filter follow transformers' logits processors: repetition
penalty, then temperature, top-k, top-p, min-p. Filter values are traced scalars (changing them
does not recompile); which filters are active is static, so greedy decoding never sorts.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from jaxllm.env import env_number
from jaxllm.model.config import FLOAT32_MAX, INT32_MAX


FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32


def number(name: str, value) -> float:
    """`value` as a float, or a ValueError naming `name` where it is not one number: None, a
    string, a bool (True is no temperature or seed), an array of more than a scalar."""
    if isinstance(value, (str, bytes)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be a number, got {value!r} (a bool)")
    if isinstance(value, (np.ndarray, np.generic, jax.Array)):
        if value.ndim != 0:
            raise ValueError(f"{name} must be a number, got an array of shape {value.shape}")
        if value.dtype == bool:
            raise ValueError(f"{name} must be a number, got {value!r} (a bool)")
        value = value.item()  # a JAX or numpy scalar: a Python number from here on
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None


def _float32(name: str, value: float, rule: str) -> float:
    """`value` where float32 holds it as a normal number (or 0): 1e39 would be inf there, 1e-46
    zero (a penalty divides by it); else a ValueError naming it."""
    with np.errstate(over="ignore", under="ignore"):
        held = float(np.float32(value))
    if value != 0 and not (math.isfinite(held) and abs(held) >= FLOAT32_TINY):
        raise ValueError(f"{name} must be {rule}, a normal float32 number (magnitude in "
                         f"[{FLOAT32_TINY:.7g}, {FLOAT32_MAX:.7g}]), got {value}")
    return value


class SamplingConfig(NamedTuple):
    """Host-side sampling settings; `static()` picks the compiled variant, `values()` the scalars."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def validate(self) -> "SamplingConfig":
        """The settings as Python numbers (JAX and numpy scalars taken), checked: a ValueError
        names the first that is not what it must be."""
        return SamplingConfig(**{name: check_setting(name, value) for name, value in self._asdict().items()})

    def static(self) -> tuple[bool, bool, bool, bool, bool]:
        """(greedy, top_k on, top_p on, min_p on, penalty on)."""
        return (self.temperature == 0, self.top_k > 0, self.top_p < 1, self.min_p > 0,
                self.repetition_penalty != 1)

    def values(self):
        return (jnp.float32(max(self.temperature, 1e-6)), jnp.int32(self.top_k), jnp.float32(self.top_p),
                jnp.float32(self.min_p), jnp.float32(self.repetition_penalty))


def check_setting(name: str, value):
    """One sampling setting (a field of SamplingConfig) as a Python number, checked."""
    x = number(name, value)
    if name == "temperature":
        if not 0 <= x < math.inf:  # NaN fails every comparison
            raise ValueError(f"temperature must be >= 0 (0 is greedy) and finite, got {value}")
        return _float32(name, x, ">= 0 (0 is greedy)")
    if name == "top_k":
        if not (0 <= x <= INT32_MAX and int(x) == x):
            raise ValueError(f"top_k must be a whole number >= 0 (0 disables it) and at most {INT32_MAX}, "
                             f"got {value}")
        return int(x)
    if name == "top_p":
        if not 0 < x <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {value}")
        return _float32(name, x, "in (0, 1]")
    if name == "min_p":
        if not 0 <= x <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {value}")
        return _float32(name, x, "in [0, 1]")
    if name == "repetition_penalty":
        if not 0 < x < math.inf:
            raise ValueError(f"repetition_penalty must be > 0 and finite, got {value}")
        return _float32(name, x, "> 0")
    raise KeyError(name)


def apply_repetition_penalty(logits_BV, seen_BV, penalty):
    """transformers' semantics: positive logits of seen tokens are divided, negative multiplied."""
    penalized = jnp.where(logits_BV < 0, logits_BV * penalty, logits_BV / penalty)
    return jnp.where(seen_BV, penalized, logits_BV)


def filter_logits(logits_BV, top_k, top_p, min_p, use_top_k: bool, use_top_p: bool, use_min_p: bool):
    """Set logits outside the top-k / top-p / min-p sets to -inf (at least one token always stays)."""
    neg_inf = jnp.float32(-jnp.inf)
    if use_top_k or use_top_p:
        sorted_BV = jnp.sort(logits_BV, axis=-1, descending=True)
        if use_top_k:
            # Like transformers: everything tied with the k-th largest value stays.
            kth_B1 = jnp.take_along_axis(sorted_BV, jnp.maximum(top_k - 1, 0)[None, None], axis=-1)
            logits_BV = jnp.where(logits_BV < kth_B1, neg_inf, logits_BV)
            sorted_BV = jnp.where(sorted_BV < kth_B1, neg_inf, sorted_BV)
        if use_top_p:
            # Keep the smallest prefix of the descending order whose mass reaches top_p: a token
            # stays while the mass strictly above it is below top_p.
            probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
            mass_above_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
            kept_BV = mass_above_BV < top_p
            kept_BV = kept_BV.at[:, 0].set(True)
            threshold_B1 = jnp.min(jnp.where(kept_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
            logits_BV = jnp.where(logits_BV < threshold_B1, neg_inf, logits_BV)
    if use_min_p:
        probs_BV = jax.nn.softmax(logits_BV, axis=-1)
        floor_B1 = min_p * jnp.max(probs_BV, axis=-1, keepdims=True)
        logits_BV = jnp.where(probs_BV < floor_B1, neg_inf, logits_BV)
    return logits_BV


# Greedy's argmax as two reductions of our own shape: each of ARGMAX_BLOCKS blocks of the
# vocabulary, then the blocks. XLA's own split of one long row ran slower: in an H200 trace of a
# Qwen3-0.6B step (151936 logits) 2.1 + 1.6 us against 3.3 + 1.4 (figures in
# `model.rotation_table`'s comment). JAXLLM_ARGMAX_BLOCKS overrides it; below 8, jnp.argmax.
ARGMAX_BLOCKS = env_number("JAXLLM_ARGMAX_BLOCKS", "128")


def _order_keys(x):
    """int32 keys that order as the floats do, NaN above +inf and -0.0 equal to 0.0. XLA's float
    argmax on a GPU picks any of several NaNs (its comparator prefers a NaN operand whatever its
    index); over these keys every tie, NaNs included, goes to the first index, as numpy's does."""
    bits = lax.bitcast_convert_type(x, jnp.int32)  # on the bits alone: no float compare flushes subnormals
    bits = jnp.where(bits == jnp.int32(-INT32_MAX - 1), 0, bits)  # -0.0 is 0.0
    keys = jnp.where(bits < 0, bits ^ jnp.int32(INT32_MAX), bits)  # negative floats: order reversed
    return jnp.where(bits & jnp.int32(INT32_MAX) > jnp.int32(0x7F800000), jnp.int32(INT32_MAX), keys)  # NaN


def argmax(logits_BV):
    """jnp.argmax over the last axis (the first of equal maxima; a NaN counts as the largest, the
    first of several NaNs on every backend), as the largest value and its index in each of up to
    ARGMAX_BLOCKS blocks, then the first block holding the largest of those."""
    B, V = logits_BV.shape
    P = ARGMAX_BLOCKS
    while P > 1 and V % P:
        P //= 2
    logits_BV = _order_keys(logits_BV)
    if P < 8:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    x_BPW = logits_BV.reshape(B, P, V // P)
    i_BP = jnp.argmax(x_BPW, axis=-1).astype(jnp.int32)
    m_BP = jnp.take_along_axis(x_BPW, i_BP[..., None], axis=-1)[..., 0]
    p_B = jnp.argmax(m_BP, axis=-1).astype(jnp.int32)
    return p_B * (V // P) + jnp.take_along_axis(i_BP, p_B[:, None], axis=1)[:, 0]


def sample(logits_BV, key, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, *,
           greedy: bool | None = None, use_top_k: bool | None = None, use_top_p: bool | None = None,
           use_min_p: bool | None = None):
    """Next token ids [B] from float32 logits [B, V]. Static flags default from concrete values.

    Concrete scalar settings are checked as generate checks them; traced ones (inside a jit) cannot
    be, and per-row ones ([B, 1] arrays) are taken as they are.
    """
    settings = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    for name, value in settings.items():
        if not isinstance(value, jax.core.Tracer) and np.ndim(value) == 0:
            settings[name] = check_setting(name, value)
    temperature, top_k, top_p, min_p = settings.values()
    greedy = (temperature == 0) if greedy is None else greedy
    if greedy:
        return argmax(logits_BV)
    use_top_k = (top_k > 0) if use_top_k is None else use_top_k
    use_top_p = (top_p < 1) if use_top_p is None else use_top_p
    use_min_p = (min_p > 0) if use_min_p is None else use_min_p
    logits_BV = logits_BV.astype(jnp.float32) / temperature
    logits_BV = filter_logits(logits_BV, jnp.asarray(top_k, jnp.int32), top_p, min_p,
                              use_top_k, use_top_p, use_min_p)
    return jax.random.categorical(key, logits_BV, axis=-1).astype(jnp.int32)
