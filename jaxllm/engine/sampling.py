"""Choosing the next token from logits: greedy, or temperature with top-k / top-p / min-p filters.

The order and the meaning of each filter follow transformers' logits processors: repetition
penalty, then temperature, top-k, top-p, min-p; presence and frequency penalties follow OpenAI's
(and vLLM's) definition, after the repetition penalty. Every setting is one value a row
(`SamplingParams`, traced: a batch mixes requests, and changing a value does not recompile);
which filters any row uses is static (`SamplingFlags`), so greedy decoding never sorts. Each row
draws with its own key, fold_in(key(seed), token index): a seed gives the same tokens whatever
else is in the batch and whichever row it sits in.
"""

import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
from flax import struct

from jaxllm.checks import INT32_MAX, float32, number, whole
from jaxllm.env import env_number


SEED_MIN, SEED_MAX = -2 ** 63, 2 ** 63 - 1  # seeds are 64-bit: all their bits reach the key


def check_setting(name: str, value):
    """One sampling setting (a field of SamplingConfig) as a Python number, checked."""
    if name == "seed":
        return whole(name, value, SEED_MIN, SEED_MAX)
    if name == "top_k":
        return whole(name, value, 0)  # 0 disables it
    x = number(name, value)
    if name == "temperature":
        if not 0 <= x < math.inf:  # NaN fails every comparison
            raise ValueError(f"temperature must be >= 0 (0 is greedy) and finite, got {value}")
        return float32(name, x, ">= 0 (0 is greedy)")
    if name == "top_p":
        if not 0 < x <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {value}")
        return float32(name, x, "in (0, 1]")
    if name == "min_p":
        if not 0 <= x <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {value}")
        return float32(name, x, "in [0, 1]")
    if name == "repetition_penalty":
        if not 0 < x < math.inf:
            raise ValueError(f"repetition_penalty must be > 0 and finite, got {value}")
        return float32(name, x, "> 0")
    if name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= x <= 2:  # OpenAI's range
            raise ValueError(f"{name} must be in [-2, 2] (0 disables it), got {value}")
        return float32(name, x, "in [-2, 2]")
    raise KeyError(name)


def _count_error(name: str, rows: int | None, got: int) -> ValueError:
    rule = f"a list of {rows} (one a row)" if rows else "a list of one value a row"
    return ValueError(f"{name} must be a number or {rule}, got {got} values")


def check_rows(name: str, value, rows: int | None = None):
    """One setting for a batch: a number (every row) as a Python number, or a list or 1-D array
    of one value a row as a tuple of them, each checked by `check_setting`; with `rows`, a list
    must hold that many. A ValueError names the setting (and the row)."""
    if not (isinstance(value, (list, tuple)) or
            isinstance(value, (np.ndarray, jax.Array)) and value.ndim == 1):
        return check_setting(name, value)
    if isinstance(value, (np.ndarray, jax.Array)):
        value = list(np.asarray(value))  # numpy scalars: a bool array's are refused by name
    if not value or rows is not None and len(value) != rows:
        raise _count_error(name, rows, len(value))
    checked = []
    for b, v in enumerate(value):
        try:
            checked.append(check_setting(name, v))
        except ValueError as e:
            raise ValueError(f"{e} (row {b})") from None
    return tuple(checked)


class SamplingFlags(NamedTuple):
    """Which parts of sampling any row uses: static (a jit compiles each combination once), so a
    greedy batch never sorts and a batch without penalties keeps no token history."""

    greedy: bool = True  # every row greedy: an argmax, no keys, no filters
    top_k: bool = False
    top_p: bool = False
    min_p: bool = False
    repetition_penalty: bool = False
    penalties: bool = False  # presence or frequency: a count of each row's generated ids
    argmax_rows: bool = False  # a sampled batch holding greedy rows (temperature 0)

    @classmethod
    def every(cls) -> "SamplingFlags":
        """Everything on: one program whatever a row asks (a server's), each row's own values
        turning what it does not use off."""
        return cls(False, True, True, True, True, True, True)


@struct.dataclass
class SamplingParams:
    """Per-row sampling settings, traced: rows with other settings share one program. A row's
    neutral values (top_k 0, top_p 1, min_p 0, penalties 1 / 0) make a filter it does not use a
    no-op where `SamplingFlags` turns that filter on for another row."""

    temperature: jax.Array  # float32 [B]; 0: the row takes its argmax
    top_k: jax.Array  # int32 [B]; 0: off
    top_p: jax.Array  # float32 [B]; 1: off
    min_p: jax.Array  # float32 [B]; 0: off
    repetition_penalty: jax.Array  # float32 [B]; 1: off
    presence_penalty: jax.Array  # float32 [B]; 0: off
    frequency_penalty: jax.Array  # float32 [B]; 0: off
    seed: jax.Array  # uint32 [B, 2]: the low and the high 32 bits of each row's seed


def seed_words(seed: int) -> tuple[int, int]:
    """A 64-bit seed's (low, high) 32-bit words, as `seed_key` reads them."""
    return seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF


def seed_key(seed_2) -> jax.Array:
    """The PRNG key of a seed given as its uint32 (low, high) words. Without x64,
    jax.random.key keeps a seed's low 32 bits, so 0 and 2**32 drew the same tokens: the high
    bits are folded in (seeds in [0, 2**32) keep the keys they had)."""
    key = jax.random.key(seed_2[0])
    high = jax.random.key_data(jax.random.fold_in(key, seed_2[1]))
    return jax.random.wrap_key_data(jnp.where(seed_2[1] != 0, high, jax.random.key_data(key)))


def row_keys(seed_B2, index) -> jax.Array:
    """[B] keys, fold_in(key(seed), index) a row: a row's draw depends on its own seed and token
    index ([] or [B]) alone, not on the batch around it."""
    index_B = jnp.broadcast_to(jnp.asarray(index, jnp.int32), seed_B2.shape[:1])
    return jax.vmap(lambda s, i: jax.random.fold_in(seed_key(s), i))(seed_B2, index_B)


class SamplingConfig(NamedTuple):
    """Host-side sampling settings, each a number (every row) or a list of one value a row:
    `validate()` checks them, `static()` picks the compiled variant, `values()` the arrays."""

    temperature: float | Sequence[float] = 0.0
    top_k: int | Sequence[int] = 0
    top_p: float | Sequence[float] = 1.0
    min_p: float | Sequence[float] = 0.0
    repetition_penalty: float | Sequence[float] = 1.0
    presence_penalty: float | Sequence[float] = 0.0
    frequency_penalty: float | Sequence[float] = 0.0
    seed: int | Sequence[int] = 0

    def validate(self, rows: int | None = None) -> "SamplingConfig":
        """The settings as Python numbers or tuples of one a row (JAX and numpy values taken),
        checked: a ValueError names the first that is not what it must be. Lists must hold
        `rows` values, or without `rows` as many as each other."""
        config = SamplingConfig(**{name: check_rows(name, value, rows) for name, value in self._asdict().items()})
        config.check_batch(rows)
        return config

    def check_batch(self, rows: int | None):
        """A ValueError where a validated list does not hold `rows` values (or, without `rows`,
        as many as the first list)."""
        for name, value in self._asdict().items():
            if isinstance(value, tuple):
                rows = len(value) if rows is None else rows
                if len(value) != rows:
                    raise _count_error(name, rows, len(value))

    def _rows(self, name: str, rows: int, dtype) -> np.ndarray:
        return np.broadcast_to(np.asarray(getattr(self, name), dtype), (rows,))

    def static(self) -> SamplingFlags:
        """Which parts any row uses (of a validated config); filters count for sampled rows only."""
        rows = max((len(v) for v in self if isinstance(v, tuple)), default=1)
        sampled = self._rows("temperature", rows, np.float64) > 0

        def on(name, used):
            return bool(np.any(used(self._rows(name, rows, np.float64)) & sampled))
        return SamplingFlags(
            greedy=not sampled.any(), top_k=on("top_k", lambda k: k > 0), top_p=on("top_p", lambda p: p < 1),
            min_p=on("min_p", lambda m: m > 0),
            repetition_penalty=bool(np.any(self._rows("repetition_penalty", rows, np.float64) != 1)),
            penalties=bool(np.any(self._rows("presence_penalty", rows, np.float64) != 0) or
                           np.any(self._rows("frequency_penalty", rows, np.float64) != 0)),
            argmax_rows=bool(sampled.any() and not sampled.all()))

    def values(self, rows: int = 1) -> SamplingParams:
        """The settings of a validated config as numpy arrays of `rows` values (a jit argument)."""
        temperature = self._rows("temperature", rows, np.float32)
        seeds = self.seed if isinstance(self.seed, tuple) else (self.seed,) * rows
        return SamplingParams(
            # A sampled row's temperature of at least 1e-6, as it was when one value held the batch
            temperature=np.where(temperature > 0, np.maximum(temperature, np.float32(1e-6)), np.float32(0)),
            top_k=self._rows("top_k", rows, np.int32), top_p=self._rows("top_p", rows, np.float32),
            min_p=self._rows("min_p", rows, np.float32),
            repetition_penalty=self._rows("repetition_penalty", rows, np.float32),
            presence_penalty=self._rows("presence_penalty", rows, np.float32),
            frequency_penalty=self._rows("frequency_penalty", rows, np.float32),
            seed=np.array([seed_words(s) for s in seeds], np.uint32).reshape(rows, 2))


def apply_repetition_penalty(logits_BV, seen_BV, penalty):
    """transformers' semantics: positive logits of seen tokens are divided, negative multiplied.
    `penalty` is a scalar or one a row [B, 1]."""
    penalized = jnp.where(logits_BV < 0, logits_BV * penalty, logits_BV / penalty)
    return jnp.where(seen_BV, penalized, logits_BV)


def apply_presence_frequency_penalty(logits_BV, counts_BV, presence, frequency):
    """OpenAI's and vLLM's: logit -= frequency * count + presence * (count > 0), with counts [B, V]
    of each row's generated tokens (the prompt's do not count); penalties scalars or [B, 1]."""
    logits_BV = logits_BV - frequency * counts_BV.astype(jnp.float32)
    return logits_BV - presence * (counts_BV > 0).astype(jnp.float32)


def _column(value, dtype):
    """A setting as a scalar (every row) or a [B, 1] column (one a row) of `dtype`."""
    x = jnp.asarray(value, dtype)
    return x if x.ndim == 0 else x.reshape(-1, 1)


def filter_logits(logits_BV, top_k, top_p, min_p, use_top_k: bool, use_top_p: bool, use_min_p: bool):
    """Set logits outside the top-k / top-p / min-p sets to -inf (at least one token always stays).
    Each setting is a scalar or one a row [B, 1]; a row's neutral value (top_k 0, top_p 1, min_p 0)
    keeps all its tokens."""
    B, V = logits_BV.shape
    neg_inf = jnp.float32(-jnp.inf)
    if use_top_k or use_top_p:
        sorted_BV = jnp.sort(logits_BV, axis=-1, descending=True)
        if use_top_k:
            # Like transformers: everything tied with the k-th largest value stays.
            k = jnp.asarray(top_k, jnp.int32)
            k = jnp.where(k > 0, jnp.minimum(k, V), V)
            kth_B1 = jnp.take_along_axis(sorted_BV, jnp.broadcast_to(k - 1, (B, 1)), axis=-1)
            logits_BV = jnp.where(logits_BV < kth_B1, neg_inf, logits_BV)
            sorted_BV = jnp.where(sorted_BV < kth_B1, neg_inf, sorted_BV)
        if use_top_p:
            # Keep the smallest prefix of the descending order whose mass reaches top_p: a token
            # stays while the mass strictly above it is below top_p. At top_p 1 every token stays,
            # though float32's running sum may reach 1 before the tail.
            probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
            mass_above_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
            kept_BV = (mass_above_BV < top_p) | (top_p >= 1)
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
# Qwen3-0.6B step (docs/decisions/loop-and-compiler.md#the-steps-tail). JAXLLM_ARGMAX_BLOCKS
# overrides it; below 8, jnp.argmax.
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
           use_min_p: bool | None = None, argmax_rows: bool | None = None):
    """Next token ids [B] from float32 logits [B, V]. Static flags default from concrete values.

    Each setting is a number (every row) or one value a row ([B] or [B, 1]); a row at temperature
    0 takes its argmax (`argmax_rows`). `key` is one key, which the rows draw from together, or
    [B] keys, one a row (`row_keys`). Concrete settings are checked as generate checks them;
    traced ones (inside a jit) cannot be: give the flags there (with a traced temperature,
    `argmax_rows` defaults to True).
    """
    B = logits_BV.shape[0]
    settings = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    for name, value in settings.items():
        if not isinstance(value, jax.core.Tracer):
            if np.ndim(value) == 2 and np.shape(value)[1] == 1:
                value = np.asarray(value).reshape(-1)  # [B, 1]: one a row
            settings[name] = check_rows(name, value, B)

    def every(name, test):  # whether test holds for every row (a concrete setting only)
        value = settings[name]
        return all(test(v) for v in (value if isinstance(value, tuple) else (value,)))
    if greedy is None:
        greedy = every("temperature", lambda t: t == 0)
    if greedy:
        return argmax(logits_BV)
    use_top_k = not every("top_k", lambda k: k == 0) if use_top_k is None else use_top_k
    use_top_p = not every("top_p", lambda p: p == 1) if use_top_p is None else use_top_p
    use_min_p = not every("min_p", lambda m: m == 0) if use_min_p is None else use_min_p
    if argmax_rows is None:
        argmax_rows = isinstance(settings["temperature"], jax.core.Tracer) or \
            not every("temperature", lambda t: t > 0)
    temperature = _column(settings["temperature"], jnp.float32)
    scaled_BV = logits_BV.astype(jnp.float32) / (jnp.where(temperature > 0, temperature, 1)
                                                 if argmax_rows else temperature)
    scaled_BV = filter_logits(scaled_BV, _column(settings["top_k"], jnp.int32),
                              _column(settings["top_p"], jnp.float32), _column(settings["min_p"], jnp.float32),
                              use_top_k, use_top_p, use_min_p)
    if jnp.ndim(key) == 0:
        token_B = jax.random.categorical(key, scaled_BV, axis=-1)
    else:  # each row its own key: its draw does not depend on the other rows
        token_B = jax.vmap(lambda k, x_V: jax.random.categorical(k, x_V))(key, scaled_BV)
    token_B = token_B.astype(jnp.int32)
    if argmax_rows:
        token_B = jnp.where(jnp.broadcast_to(temperature, (B, 1))[:, 0] == 0, argmax(logits_BV), token_B)
    return token_B


# What plain decoding applies before each pick, shared by generate, the batching engine and
# speculative rounds (a round without drafts must draw exactly what plain decoding draws).

def seen_from_prompt(tokens_BT, start_B, vocab: int):
    """[B, V] bool: which ids occur in each row's prompt (padding excluded)."""
    B, T = tokens_BT.shape
    real_BT = jnp.arange(T)[None, :] >= start_B[:, None]
    return jnp.zeros((B, vocab), bool).at[jnp.arange(B)[:, None], tokens_BT].max(real_BT)


def penalty_history(tokens_BT, start_B, vocab: int, flags: SamplingFlags):
    """What the penalties read of each row's tokens, only where `flags` use it: (seen [B, V] bool,
    the prompt's ids and then the generated ones, for the repetition penalty; counts [B, V] int32
    of the generated ids, for presence and frequency), None for a part no row uses."""
    seen = seen_from_prompt(tokens_BT, start_B, vocab) if flags.repetition_penalty else None
    return seen, jnp.zeros((tokens_BT.shape[0], vocab), jnp.int32) if flags.penalties else None


def record(history, token_B, live_B):
    """`history` with each live row's new token counted."""
    seen, counts = history
    rows = jnp.arange(token_B.shape[0])
    if seen is not None:
        seen = seen.at[rows, token_B].max(live_B)
    if counts is not None:
        counts = counts.at[rows, token_B].add(live_B.astype(jnp.int32))
    return seen, counts


def penalize(logits_BV, history, sampling: SamplingParams, flags: SamplingFlags):
    """The repetition, presence and frequency penalties the flags turn on, each row its own."""
    seen_BV, counts_BV = history
    if flags.repetition_penalty:
        logits_BV = apply_repetition_penalty(logits_BV, seen_BV, sampling.repetition_penalty[:, None])
    if flags.penalties:
        logits_BV = apply_presence_frequency_penalty(logits_BV, counts_BV, sampling.presence_penalty[:, None],
                                                     sampling.frequency_penalty[:, None])
    return logits_BV


def choose(logits_BV, history, sampling: SamplingParams, index, flags: SamplingFlags):
    """Penalties, then `sample`, each row with its key folded by its token `index` ([] or [B])."""
    logits_BV = penalize(logits_BV, history, sampling, flags)
    with jax.named_scope("sampling"):
        keys = None if flags.greedy else row_keys(sampling.seed, index)
        return sample(logits_BV, keys, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p,
                      greedy=flags.greedy, use_top_k=flags.top_k, use_top_p=flags.top_p, use_min_p=flags.min_p,
                      argmax_rows=flags.argmax_rows)
