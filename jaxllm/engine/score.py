"""Perplexity: a model's next-token loss on token ids (`jaxllm perplexity FILE` prints it).

The text is tokenized as the model's tokenizer does it (special tokens included where it adds
any), cut to --max-tokens, and scored in windows of C = --context tokens through the pure
`jaxllm.forward`. Consecutive windows share one token: window w holds tokens
[w*(C-1), w*(C-1) + C), so every token after the first is predicted exactly once, from the
tokens before it in its window (1 to C-1 of them). That costs one forward per C-1 tokens; a
strided sliding window would give each token more context, and a lower number, at several times
the cost. Compare perplexities only at the same --context and --max-tokens.
The last window is padded at its end (causal attention: padding never reaches the positions
before it) with its padding masked, and windows go --batch at a time, so every call has one shape.

nll: the mean over predicted tokens of -log p(token | its window's prefix), natural log, from
optax's softmax cross-entropy on the float32 logits; ppl = exp(nll).
"""

from __future__ import annotations

import math

import numpy as np

from jaxllm.checks import token_ids
from jaxllm.engine.steps import forward


def windows(ids, context: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [W, C] int32, mask [W, C-1] bool): windows sharing one token, the last padded.

    mask[w, t] says whether token t+1 of window w is a real token to predict.
    """
    ids = np.asarray(ids)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise ValueError(f"ids must be a list of integer token ids, got shape {ids.shape} and dtype {ids.dtype}")
    if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max):
        raise ValueError(f"token id {ids.min() if ids.min() < 0 else ids.max()} out of range")
    ids = ids.astype(np.int32)
    if context < 2:
        raise ValueError(f"context must be >= 2 tokens (one to condition on, one to predict), got {context}")
    if len(ids) < 2:
        raise ValueError(f"the text has {len(ids)} token(s); perplexity needs at least 2")
    stride = context - 1
    count = -(-(len(ids) - 1) // stride)
    tokens = np.zeros((count, context), np.int32)
    mask = np.zeros((count, stride), bool)
    for w in range(count):
        piece = ids[w * stride:w * stride + context]
        tokens[w, :len(piece)] = piece
        mask[w, :len(piece) - 1] = True
    return tokens, mask


def _loss_sum(logits_BTV, tokens_BT, mask_BT):
    import jax.numpy as jnp
    import optax
    nll_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV[:, :-1], tokens_BT[:, 1:])
    return jnp.sum(jnp.where(mask_BT, nll_BT, 0.0))


def perplexity(params, ids, context: int = 512, batch: int = 4) -> dict:
    """{"nll", "ppl", "tokens" (predicted), "windows"} of the token ids `ids` under `params`."""
    import jax

    tokens, mask = windows(token_ids(ids, params.config.vocab_size), context)  # windows checks the shape
    rows = len(tokens)
    batch = max(1, min(batch, rows))
    pad = -rows % batch  # whole batches: one compiled shape
    tokens = np.concatenate([tokens, np.zeros((pad, context), np.int32)])
    mask = np.concatenate([mask, np.zeros((pad, context - 1), bool)])
    loss = jax.jit(_loss_sum)
    total = 0.0
    for b in range(0, len(tokens), batch):
        logits = forward(params, tokens[b:b + batch])
        total += float(loss(logits, tokens[b:b + batch], mask[b:b + batch]))
    predicted = int(mask.sum())
    nll = total / predicted
    return dict(nll=nll, ppl=math.exp(nll), tokens=predicted, windows=rows)
