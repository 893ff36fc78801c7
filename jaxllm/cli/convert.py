"""`jaxllm convert SRC DST`: a model converted once into jaxllm's layout, saved as an orbax checkpoint."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import jax
from jax.sharding import Mesh

from jaxllm.cli.common import directory_arg, mesh_of, positive_int
from jaxllm.io import paths
from jaxllm.io.checkpoint import save
from jaxllm.io.loader import load
from jaxllm.text.tokenizer import load_tokenizer


def convert(src: str | os.PathLike | None, dst: str | os.PathLike, *, dtype=None, mesh: Mesh | None = None,
            quant: str = "none") -> Path:
    """`jaxllm convert SRC DST`: load a HF directory or GGUF file (None: the default model) on one
    device or sharded over `mesh` (for models larger than one device), optionally quantized to
    int8 (one device), and save it."""
    paths.make_empty_dir(Path(dst).absolute())  # before the load, which may take minutes
    out = save(load(src, dtype=dtype, mesh=mesh, quant=quant), dst)
    try:  # beside the weights, so DST alone serves `jaxllm generate --model DST`
        tok = load_tokenizer(src)
    except (FileNotFoundError, ValueError):
        return out  # a weights-only source: the checkpoint is still whole
    if jax.process_index() == 0:
        tok.save(out)
    return out


def add_convert(subparsers) -> None:
    p = subparsers.add_parser(
        "convert", help="write a model's converted (optionally int8) params as an orbax checkpoint",
        description="Convert a Hugging Face directory or GGUF file once into jaxllm's layout and save it "
                    "as an orbax checkpoint; `jaxllm.load(DST, mesh=...)` (or --model DST) restores it, "
                    "sharded onto any mesh, without converting again.")
    p.add_argument("src", nargs="?", default=None, metavar="SRC",
                   help="HF directory or .gguf file (default: the default model)")
    p.add_argument("dst", type=directory_arg, metavar="DST", help="an empty or new directory")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="dtype of the saved weights (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--quant", choices=("none", "int8"), default="none",
                   help="save int8 weights with per-output-channel scales (restores onto one device)")
    p.add_argument("--tp", type=positive_int, default=1, metavar="N",
                   help="convert sharded over N devices, for a model larger than one device")
    p.set_defaults(run=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    out = convert(args.src, args.dst, dtype=args.dtype, mesh=mesh_of(args.tp), quant=args.quant)
    print(f"jaxllm: wrote {out} in {time.perf_counter() - t0:.1f} s; load it with --model {out}",
          file=sys.stderr)
    return 0
