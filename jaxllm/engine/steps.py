"""The checked entry points of the model: forward, prefill and decode_step.

Each checks its tokens, the cache's room and (forward) the memory a request needs on the host,
then runs the pure, unchecked programs of model/transformer.py.
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.checks import token_ids
from jaxllm.engine.memory import check_fit
from jaxllm.model.cache import KVCache
from jaxllm.model.params import Params, require_params
from jaxllm.model.transformer import _forward, jitted_step


def forward(params: Params, tokens_BT) -> jax.Array:
    """Logits [B, T, V] (float32) of whole sequences, no cache kept (scoring, tests)."""
    tokens = token_ids(tokens_BT, require_params(params).config.vocab_size)
    if tokens.ndim != 2 or tokens.shape[1] == 0:
        raise ValueError(f"tokens must be a non-empty [B, T] array, got shape {tokens.shape}")
    if tokens.shape[1] > params.config.max_position_embeddings:
        raise ValueError(f"{tokens.shape[1]} tokens exceed the model's context of "
                         f"{params.config.max_position_embeddings}")
    check_fit(params, *tokens.shape, tokens.shape[1], all_logits=True)
    return _forward(params, jnp.asarray(tokens))


def check_kv_int8(params: Params, int8: bool) -> None:
    """ValueError for an int8 KV cache with sharded params, which the model cannot run yet."""
    if int8 and params.tp is not None:
        raise ValueError("an int8 KV cache with tensor-parallel (sharded) params is not implemented yet")


def _check_room(cache: KVCache, new: int, params: Params) -> int:
    """The cache's furthest row end, after checking that it is this model's and that `new` more
    tokens fit in every row."""
    cfg = require_params(params).config
    made = (len(cache.k), cache.k[0].shape[1], cache.k[0].shape[3]) if cache.k else (0, 0, 0)
    if made != (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim):
        raise ValueError(f"the cache was made for another model: {made[0]} layers of {made[1]} KV heads of "
                         f"{made[2]} values, where this model has {cfg.num_layers} layers of "
                         f"{cfg.num_kv_heads} KV heads of {cfg.head_dim}")
    check_kv_int8(params, cache.k_scale is not None)
    start, end = (np.asarray(x) for x in jax.device_get((cache.start, cache.end)))
    furthest = int(end.max())
    if furthest + new > cache.length:
        raise ValueError(f"cache full: writing {new} token(s) at slot {furthest} needs "
                         f"{furthest + new} slots, the cache has {cache.length}")
    context = params.config.max_position_embeddings
    last = int((end - start).max()) + new - 1  # the position of the longest row's last token
    if last >= context:
        raise ValueError(f"writing {new} token(s) at slot {furthest} reaches position {last}, past the "
                         f"model's context of {context} tokens")
    return furthest


def prefill(params: Params, tokens_BT, cache: KVCache):
    """Write a [B, T] block of prompt tokens (left-padded to cache.start); logits [B, V] of the last."""
    tokens = token_ids(tokens_BT, require_params(params).config.vocab_size)
    if tokens.ndim != 2 or tokens.shape[1] == 0 or tokens.shape[0] != cache.batch:
        raise ValueError(f"prefill needs [B={cache.batch}, T>0] tokens, got shape {tokens.shape}")
    fresh = _check_room(cache, tokens.shape[1], params) == 0
    return jitted_step()(params, jnp.asarray(tokens), cache, fresh=fresh)


def decode_step(params: Params, tokens_B, cache: KVCache, rotation=None):
    """Write one token per row at the row's end; returns (logits [B, V], cache). The cache is donated.

    `rotation`: `rotation_table(params.config, cache.length)`, made once by a loop of steps
    (unsharded params), which spares each step making it."""
    tokens = token_ids(tokens_B, require_params(params).config.vocab_size)
    if tokens.shape != (cache.batch,):
        raise ValueError(f"decode_step needs [B={cache.batch}] tokens, got shape {tokens.shape}")
    _check_room(cache, 1, params)
    return jitted_step()(params, jnp.asarray(tokens)[:, None], cache, rotation=rotation)
