"""The KV cache: preallocated, immutable, one [B, K, S, H] pair per layer and per-row bounds.

Row b's live slots are [start_b, end_b): a left-padded prompt begins at start_b, the row's next
token goes to slot end_b, and its token at slot s sits at position s - start_b. Its size is
exactly 2 * L * B * S * K * H * itemsize; nothing else grows per token.

Why a write position per row and no ring buffer: speculative decoding accepts a different number
of tokens per row and a server inserts requests at different times; with one shared cursor a
rollback leaves holes, while per-row ends (gemma's `end_index[B]`, MaxText/JetStream's per-slot
positions) make `insert`, `rollback` and `release` O(1) bookkeeping, and as every row owns slots
[0, S) nothing wraps.
"""


import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxllm.checks import whole
from jaxllm.model.config import ModelConfig


@struct.dataclass
class KVCache:
    k: list[jax.Array]  # per layer [B, K, S, H]
    v: list[jax.Array]  # per layer [B, K, S, H]
    start: jax.Array  # int32 [B]: first slot holding a real token, per row
    end: jax.Array  # int32 [B]: the next slot to write, per row (live slots [start, end))
    # int8 caches only: one float32 scale per (row, KV head, slot), k ~= k_int8 * scale.
    k_scale: list[jax.Array] | None = None  # per layer [B, K, S]
    v_scale: list[jax.Array] | None = None

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def length(self) -> int:  # S
        return self.k[0].shape[2]

    @property
    def lengths(self) -> jax.Array:
        """int32 [B]: each row's token count, the position its next token takes."""
        return self.end - self.start


def init_cache(config: ModelConfig, batch: int, length: int, dtype=jnp.bfloat16, start=None,
               kv_dtype=None) -> KVCache:
    """An empty cache of `length` slots for `batch` rows (every end 0); `start` defaults to 0.

    `kv_dtype` "int8" (or jnp.int8) stores keys and values as int8 with a float32 scale per
    (row, KV head, slot): half the bytes a decode step reads from the cache. Default: `dtype`.
    """
    if not isinstance(config, ModelConfig):
        hint = " (params.config)" if hasattr(config, "config") else ""
        raise TypeError(f"init_cache takes the model's ModelConfig{hint}, got {type(config).__name__}")
    batch, length = (whole(f"cache {name}", n, 1, floats=False) for name, n in (("batch", batch),
                                                                                ("length", length)))
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
                   start=start, end=jnp.zeros((batch,), jnp.int32), k_scale=scales(), v_scale=scales())


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


def insert(cache: KVCache, prefix: KVCache, row) -> KVCache:
    """`cache` with row `row` (an int32 in [0, B), traced, never static) holding the one-row
    cache `prefix`.

    `prefix` (batch 1, P <= S slots, e.g. a fresh prefill of one prompt) fills the row's slots
    [0, P), every layer and int8 scale, and gives the row its start and end; the row's slots past
    P keep stale values that its mask never shows. One jitted, donated call updates the cache in
    place: `jax.jit(insert, donate_argnums=0)`.
    """
    if prefix.batch != 1 or prefix.length > cache.length or len(prefix.k) != len(cache.k) or \
            prefix.k[0].shape[1::2] != cache.k[0].shape[1::2] or prefix.k[0].dtype != cache.k[0].dtype:
        raise ValueError(f"insert takes a one-row cache of at most {cache.length} slots of this "
                         f"cache's layers, heads and dtype; got {prefix.batch} row(s) of "
                         f"{prefix.length} slots, {len(prefix.k)} layers, "
                         f"{prefix.k[0].shape[1::2]} heads x dims, {prefix.k[0].dtype}")
    zero = jnp.zeros((), jnp.int32)
    row = jnp.asarray(row, jnp.int32)
    put = lambda into, x: jax.lax.dynamic_update_slice(into, x, (row,) + (zero,) * (into.ndim - 1))
    puts = lambda into, xs: None if into is None else [put(a, x) for a, x in zip(into, xs, strict=True)]
    return cache.replace(k=puts(cache.k, prefix.k), v=puts(cache.v, prefix.v),
                         k_scale=puts(cache.k_scale, prefix.k_scale),
                         v_scale=puts(cache.v_scale, prefix.v_scale),
                         start=put(cache.start, prefix.start), end=put(cache.end, prefix.end))


def rollback(cache: KVCache, counts_B) -> KVCache:
    """Shorten each row by counts_B [B] tokens (never below its start): the rejected slots become
    invisible, and the row's next write overwrites them."""
    end = cache.end - jnp.asarray(counts_B, jnp.int32)
    return cache.replace(end=jnp.maximum(end, jnp.minimum(cache.start, cache.end)))


def release(cache: KVCache, rows_B) -> KVCache:
    """Empty the rows where rows_B [B] (bool) is true (start = end = 0), ready for `insert`: a row
    sees only slots below its own end, so its previous occupant's stay unseen."""
    keep = ~jnp.asarray(rows_B, bool)
    return cache.replace(start=jnp.where(keep, cache.start, 0), end=jnp.where(keep, cache.end, 0))
