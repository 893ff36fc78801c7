"""`jaxllm roofline CONFIG`: the roofline table of one model step (tools/roofline.py)."""

from __future__ import annotations

import argparse
import json
import sys

import jax.numpy as jnp

from jaxllm.checks import argtype
from jaxllm.tools.presets import PRESETS, get_config
from jaxllm.tools.roofline import (H200_BF16_MATMUL_FLOPS, H200_HBM_BW, MAX_SIZE, _dtype_name, analyze,
                                   format_table)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help=f"a preset ({', '.join(PRESETS)}) or a Hugging Face checkpoint directory")
    p.add_argument("--batch", type=argtype(1, MAX_SIZE), default=1, help="rows per step (B)")
    p.add_argument("--context", type=argtype(0, MAX_SIZE), default=None,
                   help="cache positions filled after the step (S); default: --tokens")
    p.add_argument("--tokens", type=argtype(1, MAX_SIZE), default=1, help="new tokens per row (T): 1 for a decode step")
    p.add_argument("--dtype", default="bfloat16", help="weight dtype: bfloat16, float16, float32, int8")
    p.add_argument("--kv-dtype", default=None, help="KV cache dtype (default: the activations' dtype)")
    p.add_argument("--peak-bw", type=float, default=H200_HBM_BW, help="bytes/s (default: H200 datasheet)")
    p.add_argument("--peak-flops", type=float, default=H200_BF16_MATMUL_FLOPS,
                   help="FLOP/s (default: H200 bf16 matmul as measured)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


_DESCRIPTION = ("Per-operator FLOPs, bytes moved and time lower bound of one model step on a device "
                "with the given peaks. A decode step: --tokens 1 --context S; a prefill: --tokens T.")


def add_roofline(subparsers) -> None:
    """The `jaxllm roofline` subcommand, in the shape of cli.SUBCOMMANDS entries."""
    p = subparsers.add_parser("roofline", help="FLOPs, bytes and time bound of one step, per operator",
                              description=_DESCRIPTION)
    _add_arguments(p)
    p.set_defaults(run=run_roofline)


def run_roofline(args: argparse.Namespace) -> int:
    """Print the table (or JSON); bad input is a ValueError naming it."""
    cfg = get_config(args.config)
    try:
        dtype, kv_dtype = jnp.dtype(_dtype_name(args.dtype)), args.kv_dtype and jnp.dtype(_dtype_name(args.kv_dtype))
    except TypeError as e:
        raise ValueError(f"unknown dtype: {e}") from None
    result = analyze(cfg, args.batch, args.context if args.context is not None else args.tokens, args.tokens,
                     dtype, kv_dtype or None, args.peak_bw, args.peak_flops, name=args.config)
    print(json.dumps(result) if args.json else format_table(result))
    return 0


def main(argv=None) -> int:
    """`jaxllm roofline ...` with its own parser: argv as after the subcommand's name."""
    p = argparse.ArgumentParser(prog="jaxllm roofline", description=_DESCRIPTION)
    _add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run_roofline(args)
    except ValueError as e:
        print(f"jaxllm roofline: error: {e}", file=sys.stderr)
        return 2
