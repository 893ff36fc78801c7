"""`jaxllm perplexity FILE`: a model's next-token loss on a text, to show what quantization costs.

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

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

_DESCRIPTION = ("Perplexity of a model on a text file: mean next-token negative log-likelihood over "
                "windows of --context tokens (each token after the first predicted once), printed as "
                "JSON. Text on every machine: the source of a Python standard-library module, e.g. "
                "$(python -c 'import argparse; print(argparse.__file__)').")


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

    import jaxllm
    from jaxllm.model import check_tokens

    tokens, mask = windows(check_tokens(params.config, ids), context)  # windows checks the shape
    rows = len(tokens)
    batch = max(1, min(batch, rows))
    pad = -rows % batch  # whole batches: one compiled shape
    tokens = np.concatenate([tokens, np.zeros((pad, context), np.int32)])
    mask = np.concatenate([mask, np.zeros((pad, context - 1), bool)])
    loss = jax.jit(_loss_sum)
    total = 0.0
    for b in range(0, len(tokens), batch):
        logits = jaxllm.forward(params, tokens[b:b + batch])
        total += float(loss(logits, tokens[b:b + batch], mask[b:b + batch]))
    predicted = int(mask.sum())
    nll = total / predicted
    return dict(nll=nll, ppl=math.exp(nll), tokens=predicted, windows=rows)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    from jaxllm.cli import _positive_int, add_model_args

    p.add_argument("file", metavar="FILE", help="a UTF-8 text file")
    add_model_args(p)
    p.add_argument("--context", type=_positive_int, default=512, metavar="C",
                   help="tokens per window (default: 512)")
    p.add_argument("--max-tokens", type=_positive_int, default=None, metavar="N",
                   help="score only the first N tokens of the text (default: all)")
    p.add_argument("--batch", type=_positive_int, default=4, metavar="B",
                   help="windows per forward call (default: 4)")


def add_perplexity(subparsers) -> None:
    """The `jaxllm perplexity` subcommand, in the shape of cli.SUBCOMMANDS entries."""
    p = subparsers.add_parser("perplexity", help="next-token perplexity of a model on a text file",
                              description=_DESCRIPTION)
    _add_arguments(p)
    p.set_defaults(run=run_perplexity)


def run_perplexity(args: argparse.Namespace) -> int:
    """Print one JSON object: ppl, nll, tokens, windows, model, quant, dtype, context, file."""
    from jaxllm.cli import UsageError, load_model

    path = Path(args.file)
    if not path.is_file():
        raise UsageError(f"no text file at {args.file}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    params, tok = load_model(args)
    ids = tok.encode(text, add_special_tokens=True)[:args.max_tokens]
    result = perplexity(params, ids, args.context, args.batch)
    from jaxllm import paths
    print(json.dumps(dict(result, model=str(args.model or paths.default_model_path()),
                          quant=args.quant, dtype=str(params.dtype), context=args.context,
                          file=str(path))))
    return 0


def main(argv=None) -> int:
    """`python -m jaxllm.perplexity ...`: the same as `jaxllm perplexity ...`."""
    from jaxllm.cli import UsageError

    p = argparse.ArgumentParser(prog="jaxllm perplexity", description=_DESCRIPTION)
    _add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run_perplexity(args)
    except (UsageError, ValueError, FileNotFoundError) as e:
        print(f"jaxllm perplexity: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
