"""`jaxllm convert SRC DST`: a model converted once into jaxllm's layout, saved as an orbax checkpoint."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import re
import shutil
import sys
import time
from pathlib import Path

import jax
from jax.sharding import Mesh

from jaxllm.cli.common import directory_arg, mesh_of, positive_int, quiet_orbax_on_interrupt
from jaxllm.io import paths
from jaxllm.io.checkpoint import save
from jaxllm.io.loader import load
from jaxllm.text.tokenizer import load_tokenizer


def convert(src: str | os.PathLike | None, dst: str | os.PathLike, *, dtype=None, mesh: Mesh | None = None,
            quant: str = "none") -> Path:
    """`jaxllm convert SRC DST`: load a HF directory or GGUF file (None: the default model) on one
    device or sharded over `mesh` (for models larger than one device), optionally quantized to
    int8 (one device), and save it.

    Written into a temporary sibling of DST and renamed to DST once whole: an interrupted or
    failed run leaves neither a partial DST nor its temporary nor the directories it made."""
    dst = Path(dst).absolute()
    _check_destination(dst)  # before the load, which may take minutes
    with _staging(dst) as tmp:
        save(load(src, dtype=dtype, mesh=mesh, quant=quant), tmp)
        try:  # beside the weights, so DST alone serves `jaxllm generate --model DST`
            tok = load_tokenizer(src)
        except (FileNotFoundError, ValueError):
            tok = None  # a weights-only source: the checkpoint is still whole
        if tok is not None and jax.process_index() == 0:
            tok.save(tmp)
    return dst


STAGING = ".converting-"  # `.<DST name>.converting-<PID>`: a convert in progress, or a dead one's


def _check_destination(dst: Path) -> None:
    """A ValueError if DST cannot take the checkpoint: a file, a non-empty directory, under a file."""
    if dst.exists():
        paths.make_empty_dir(dst)  # refuses a file or a non-empty directory; an empty one stays
        return
    for parent in dst.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{dst} cannot be made: {parent} is not a directory")
            return


@contextlib.contextmanager
def _staging(dst: Path):
    """A temporary directory beside `dst`, renamed to `dst` when the block ends normally; on any
    exception (Ctrl-C, SIGTERM through the CLI, a bad source) it is removed, with the parents this
    run made."""
    made = [p for p in [dst.parent, *dst.parent.parents] if not p.exists()]
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{dst} cannot be made: {e.strerror or e}") from None
    prefix = f".{dst.name}{STAGING}"
    paths.remove_stale(dst.parent, re.escape(prefix) + r"(\d+)")  # a killed (SIGKILL) run's leftovers
    tmp = dst.parent / f"{prefix}{os.getpid()}"
    try:
        yield tmp
        if jax.process_index() == 0:
            try:  # over an empty DST too: rename(2) replaces an empty directory
                os.replace(tmp, dst)
            except OSError as e:
                raise ValueError(f"{dst} cannot be written: {e.strerror or e}") from None
    except BaseException:
        _remove(tmp, made)
        # An interrupted save's background writers may still add files until the process ends:
        # remove again at exit, once they are done (Python joins them before atexit runs).
        atexit.register(_remove, tmp, made)
        raise


def _remove(tmp: Path, made: list[Path]) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    for p in made:  # deepest first; only if still empty
        with contextlib.suppress(OSError):
            p.rmdir()


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
    quiet_orbax_on_interrupt()
    out = convert(args.src, args.dst, dtype=args.dtype, mesh=mesh_of(args.tp), quant=args.quant)
    print(f"jaxllm: wrote {out} in {time.perf_counter() - t0:.1f} s; load it with --model {out}",
          file=sys.stderr)
    return 0
