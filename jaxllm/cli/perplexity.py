"""`jaxllm perplexity FILE`: a model's next-token loss on a text file, printed as JSON (engine/score.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jaxllm.cli.common import UsageError, add_model_args, load_model, positive_int
from jaxllm.engine.score import perplexity
from jaxllm.io import paths

_DESCRIPTION = ("Perplexity of a model on a text file: mean next-token negative log-likelihood over "
                "windows of --context tokens (each token after the first predicted once), printed as "
                "JSON. Text on every machine: the source of a Python standard-library module, e.g. "
                "$(python -c 'import argparse; print(argparse.__file__)').")


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE", help="a UTF-8 text file")
    add_model_args(p)
    p.add_argument("--context", type=positive_int, default=512, metavar="C",
                   help="tokens per window (default: 512)")
    p.add_argument("--max-tokens", type=positive_int, default=None, metavar="N",
                   help="score only the first N tokens of the text (default: all)")
    p.add_argument("--batch", type=positive_int, default=4, metavar="B",
                   help="windows per forward call (default: 4)")


def add_perplexity(subparsers) -> None:
    """The `jaxllm perplexity` subcommand, in the shape of cli.SUBCOMMANDS entries."""
    p = subparsers.add_parser("perplexity", help="next-token perplexity of a model on a text file",
                              description=_DESCRIPTION)
    _add_arguments(p)
    p.set_defaults(run=run_perplexity)


def run_perplexity(args: argparse.Namespace) -> int:
    """Print one JSON object: ppl, nll, tokens, windows, model, quant, dtype, context, file."""
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
    print(json.dumps(dict(result, model=str(args.model or paths.default_model_path()),
                          quant=args.quant, dtype=str(params.dtype), context=args.context,
                          file=str(path))))
    return 0


def main(argv=None) -> int:
    """`jaxllm perplexity ...` with its own parser: argv as after the subcommand's name."""
    p = argparse.ArgumentParser(prog="jaxllm perplexity", description=_DESCRIPTION)
    _add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run_perplexity(args)
    except (UsageError, ValueError, FileNotFoundError) as e:
        print(f"jaxllm perplexity: error: {e}", file=sys.stderr)
        return 2
