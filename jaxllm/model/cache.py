"""The KV cache: preallocated, immutable, one [B, K, S, H] pair per layer and one write cursor.

All rows write at the shared `cursor`; a left-padded ragged batch keeps each row's first real
slot in `start`, so row b's token at slot s sits at position s - start[b]. Its size is exactly
2 * L * B * S * K * H * itemsize; nothing else grows per token.
"""

import numbers

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxllm.model.config import INT32_MAX, ModelConfig


@struct.dataclass
class KVCache:
    k: list[jax.Array]  # per layer [B, K, S, H]
    v: list[jax.Array]  # per layer [B, K, S, H]
    cursor: jax.Array  # int32 []: the next slot to write (slots filled so far)
    start: jax.Array  # int32 [B]: first slot holding a real token, per row
    # int8 caches only: one float32 scale per (row, KV head, slot), k ~= k_int8 * scale.
    k_scale: list[jax.Array] | None = None  # per layer [B, K, S]
    v_scale: list[jax.Array] | None = None

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def length(self) -> int:  # S
        return self.k[0].shape[2]


def init_cache(config: ModelConfig, batch: int, length: int, dtype=jnp.bfloat16, start=None,
               kv_dtype=None) -> KVCache:
    """An empty cache of `length` slots for `batch` rows; `start` defaults to 0 for every row.

    `kv_dtype` "int8" (or jnp.int8) stores keys and values as int8 with a float32 scale per
    (row, KV head, slot): half the bytes a decode step reads from the cache. Default: `dtype`.
    """
    if not isinstance(config, ModelConfig):
        hint = " (params.config)" if hasattr(config, "config") else ""
        raise TypeError(f"init_cache takes the model's ModelConfig{hint}, got {type(config).__name__}")
    for name, n in (("batch", batch), ("length", length)):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or not 1 <= n <= INT32_MAX:
            raise ValueError(f"cache {name} must be a whole number >= 1 and at most 2**31 - 1 (slots and rows "
                             f"are int32), got {n!r}")
    if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
        raise ValueError(f"cache dtype must be a floating type (kv_dtype='int8' for an int8 cache), got {dtype}")
    L = config.num_layers
    shape = (batch, config.num_kv_heads, length, config.head_dim)
    if start is not None and not isinstance(start, jax.core.Tracer):  # a traced start is checked where it is made
        given = np.asarray(start)
        if given.shape != (batch,) or given.dtype.kind not in "iu" or given.min() < 0 or given.max() >= length:
            raise ValueError(f"start must be {batch} whole numbers in [0, {length}) (each row's first slot), "
                             f"got {given.tolist()}")
    start = jnp.zeros((batch,), jnp.int32) if start is None else jnp.asarray(start, jnp.int32)
    int8 = is_int8(kv_dtype)
    store = jnp.int8 if int8 else dtype
    # Distinct arrays for every leaf: the cache is donated, and one buffer cannot be donated twice.
    scales = (lambda: [jnp.ones(shape[:3], jnp.float32) for _ in range(L)]) if int8 else (lambda: None)
    return KVCache(k=[jnp.zeros(shape, store) for _ in range(L)], v=[jnp.zeros(shape, store) for _ in range(L)],
                   cursor=jnp.zeros((), jnp.int32), start=start, k_scale=scales(), v_scale=scales())


def is_int8(kv_dtype) -> bool:
    """Whether a kv_dtype setting asks for the int8 cache: None or "auto" keep the model dtype."""
    if kv_dtype is None or (isinstance(kv_dtype, str) and kv_dtype == "auto"):
        return False
    try:
        if jnp.dtype(kv_dtype) == jnp.int8:
            return True
    except TypeError:
        pass
    raise ValueError(f"unsupported kv_dtype {kv_dtype!r}: 'int8', or None / 'auto' for the model's dtype")


def cache_bytes(config: ModelConfig, batch: int, length: int, dtype=jnp.bfloat16, kv_dtype=None) -> int:
    """Bytes of the whole cache: 2 * L * B * S * K * (H * itemsize, plus a float32 scale if int8)."""
    int8 = is_int8(kv_dtype)
    per_slot = config.head_dim + 4 if int8 else config.head_dim * jnp.dtype(dtype).itemsize
    return 2 * config.num_layers * batch * length * config.num_kv_heads * per_slot
