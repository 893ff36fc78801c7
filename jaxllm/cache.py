"""The KV cache: preallocated, immutable, one [B, K, S, H] pair per layer and one write cursor.

All rows write at the shared `cursor`; a left-padded ragged batch keeps each row's first real
slot in `start`, so row b's token at slot s sits at position s - start[b]. Its size is exactly
2 * L * B * S * K * H * itemsize; nothing else grows per token.
"""

import jax
import jax.numpy as jnp
from flax import struct

from jaxllm.config import ModelConfig


@struct.dataclass
class KVCache:
    k: list[jax.Array]  # per layer [B, K, S, H]
    v: list[jax.Array]  # per layer [B, K, S, H]
    cursor: jax.Array  # int32 []: the next slot to write (slots filled so far)
    start: jax.Array  # int32 [B]: first slot holding a real token, per row

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def length(self) -> int:  # S
        return self.k[0].shape[2]


def init_cache(config: ModelConfig, batch: int, length: int, dtype=jnp.bfloat16, start=None) -> KVCache:
    """An empty cache of `length` slots for `batch` rows; `start` defaults to 0 for every row."""
    shape = (batch, config.num_kv_heads, length, config.head_dim)
    start = jnp.zeros((batch,), jnp.int32) if start is None else jnp.asarray(start, jnp.int32)
    return KVCache(k=[jnp.zeros(shape, dtype) for _ in range(config.num_layers)],
                   v=[jnp.zeros(shape, dtype) for _ in range(config.num_layers)],
                   cursor=jnp.zeros((), jnp.int32), start=start)


def cache_bytes(config: ModelConfig, batch: int, length: int, dtype=jnp.bfloat16) -> int:
    return 2 * config.num_layers * batch * length * config.num_kv_heads * config.head_dim * \
        jnp.dtype(dtype).itemsize
