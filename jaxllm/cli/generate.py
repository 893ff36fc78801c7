"""`jaxllm generate` and `jaxllm chat`: a prompt's answer, or a conversation, streamed as text."""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from typing import Iterator

import jaxllm
from jaxllm.cli.common import (UsageError, add_model_args, add_sampling_args, add_system_arg, add_trace_arg,
                               add_draft_quant_arg, check_speculative_args, load_draft, load_model,
                               sampling_kwargs)
from jaxllm.tools.trace import trace


def stop_ids(params, tok) -> list[int]:
    """The model's stop ids and the tokenizer's (a chat model's end-of-turn token among them)."""
    return list(dict.fromkeys([*params.config.eos_token_ids, *tok.eos_token_ids]))


def _tracer(trace_dir: str):
    """`jaxllm.tools.trace.trace`, which says how to open the trace."""
    return trace(trace_dir)


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


def add_speculative_args(parser: argparse.ArgumentParser) -> None:
    """--speculate, --draft-model, --num-speculative, --verbose."""
    g = parser.add_argument_group("speculative decoding (same answer when greedy, same law when sampling)")
    g.add_argument("--speculate", choices=("ngram",), default=None,
                   help="ngram: propose the tokens that followed the last few tokens' earlier occurrence "
                        "in the prompt or the answer (fast on rewrites, summaries, extraction)")
    g.add_argument("--draft-model", metavar="PATH", default=None,
                   help="a smaller checkpoint with the same tokenizer proposes the tokens")
    add_draft_quant_arg(g)
    g.add_argument("--num-speculative", type=int, default=None, metavar="K",
                   help="tokens proposed a round (default: 7 for ngram, 3 for a draft model, "
                        "speculation paused while few are accepted)")
    g.add_argument("--verbose", action="store_true",
                   help="after each answer, print the acceptance rate, its histogram and tokens per step")


def speculative_kwargs(args: argparse.Namespace) -> dict:
    """`generate`/`stream` keywords of the speculative flags; loads the draft model if given."""
    check_speculative_args(args)
    if args.num_speculative is not None and not 1 <= args.num_speculative <= 32:
        raise UsageError(f"--num-speculative must be in [1, 32], got {args.num_speculative}")
    if args.draft_model:
        return dict(speculative=load_draft(args), num_speculative=args.num_speculative)
    if args.speculate:
        return dict(speculative=args.speculate, num_speculative=args.num_speculative)
    return {}


def _keep_return(gen, box: list):
    """Yield what `gen` yields; append its return value to `box`."""
    box.append((yield from gen))


def stream_text(params, tok, ids: list[int], kwargs: dict, out=None, trace_dir: str | None = None,
                stoppable: bool = False, verbose: bool = False) -> str:
    """Generate from `ids`, writing each complete piece of text to `out` as it comes; returns the text.

    An answer cut by max_new_tokens says so on stderr. `stoppable`: Ctrl-C ends the answer (what
    was shown is returned) instead of the command. `verbose`: speculative decoding's acceptance
    after the answer."""
    out = out or sys.stdout
    stops = stop_ids(params, tok)
    detok = tok.stream()
    pieces, notes, stats = [], [], []
    count, stopped, ended = 0, False, False
    tokens = jaxllm.stream(params, ids, eos_token_ids=stops, **kwargs)
    try:
        # `stream` ends after a stop token, which is not shown; running it out lets the trace close.
        for token in _traced(_keep_return(tokens, stats), trace_dir, notes):
            count += 1
            if token in stops:
                ended = True
                continue
            piece = detok.push(token)
            if piece:
                out.write(piece)
                out.flush()
                pieces.append(piece)
    except KeyboardInterrupt:
        if not stoppable:
            raise
        stopped = True
        tokens.close()
    tail = detok.flush()
    out.write(tail + "\n")
    out.flush()
    for note in notes:
        print(note, file=sys.stderr)
    if stopped:
        print("jaxllm: answer stopped (Ctrl-C)", file=sys.stderr)
    elif not ended and count == kwargs["max_new_tokens"]:  # `stream` ran out, no stop token came
        print(f"jaxllm: stopped at --max-new-tokens {count}", file=sys.stderr)
    if verbose and stats and stats[0] is not None:
        st = stats[0]
        print(f"jaxllm: speculative k={st.k}: {st.accepted}/{st.drafted} drafts accepted "
              f"({st.acceptance_rate:.1%}), {st.tokens_per_step:.2f} tokens per target step, "
              f"{st.verify_rounds} of {st.rounds} steps verified; accepted-count histogram "
              f"{list(st.histogram)}", file=sys.stderr)
    pieces.append(tail)
    return "".join(pieces)


def encode_chat(tok, messages: list[dict]) -> list[int]:
    """The chat template rendered over the whole history, then encoded (the template holds the BOS)."""
    text = tok.apply_chat_template(messages, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def add_generate(subparsers) -> None:
    p = subparsers.add_parser("generate", help="answer one prompt, streaming the text",
                              description="Answer one prompt, streaming the text as it is produced. "
                                          "The chat template is applied when the model has one.")
    p.add_argument("prompt", help="the prompt (the user message, or raw text with --no-chat)")
    add_model_args(p)
    add_system_arg(p)
    add_trace_arg(p)
    add_sampling_args(p)
    add_speculative_args(p)
    p.add_argument("--no-chat", action="store_true",
                   help="feed the prompt as raw text, without the chat template")
    p.set_defaults(run=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    kwargs = sampling_kwargs(args)
    kwargs.update(speculative_kwargs(args))  # flags checked before the model loads
    params, tok = load_model(args)
    if args.no_chat or tok.chat_template is None:
        if args.system is not None:
            raise UsageError("--system needs the chat template (the model has none, or --no-chat was given)")
        ids = tok.encode(args.prompt, add_special_tokens=True)
    else:
        messages = [{"role": "system", "content": args.system}] if args.system is not None else []
        ids = encode_chat(tok, messages + [{"role": "user", "content": args.prompt}])
    stream_text(params, tok, ids, kwargs, trace_dir=args.trace_dir, verbose=args.verbose)
    return 0


CHAT_HELP = ("/reset clears the history; /help lists these commands; Ctrl-C stops an answer; /exit, "
             "Ctrl-D or Ctrl-C at the prompt ends.")


def add_chat(subparsers) -> None:
    p = subparsers.add_parser("chat", help="talk with the model; /help lists the commands",
                              description="An interactive chat that keeps the history: one user "
                                          "message per line. " + CHAT_HELP)
    add_model_args(p)
    add_system_arg(p)
    add_trace_arg(p)
    add_sampling_args(p)
    add_speculative_args(p)
    p.set_defaults(run=run_chat)


def run_chat(args: argparse.Namespace) -> int:
    kwargs = sampling_kwargs(args)
    kwargs.update(speculative_kwargs(args))  # flags checked before the model loads
    params, tok = load_model(args)
    if tok.chat_template is None:
        raise UsageError("this model has no chat template; use `jaxllm generate --no-chat`")
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    history: list[dict] = []
    # The prompt grows each turn and crosses length buckets: those recompilations are expected here.
    warnings.filterwarnings("ignore", message="jaxllm: recompiling")
    interactive = sys.stdin.isatty()
    if interactive:
        print("jaxllm chat: /help lists the commands, /exit or Ctrl-D ends", file=sys.stderr)
    while True:
        try:
            line = input(">>> " if interactive else "")
        except (EOFError, KeyboardInterrupt):  # Ctrl-D, or Ctrl-C at the prompt: the chat ends
            if interactive:
                print()  # leaves the cursor after the prompt
            break
        text = line.strip()
        if text == "/exit":
            break
        if text == "/help":
            print(f"jaxllm chat: {CHAT_HELP}", file=sys.stderr)
            continue
        if text == "/reset":
            history.clear()
            print("(history cleared)", file=sys.stderr)
            continue
        if not text:
            continue
        messages = system + history + [{"role": "user", "content": text}]
        try:
            # Re-rendering the whole history each turn is simple and always what the template means.
            answer = stream_text(params, tok, encode_chat(tok, messages), kwargs, trace_dir=args.trace_dir,
                                 stoppable=True, verbose=args.verbose)
        except ValueError as e:  # e.g. the history outgrew the context: keep the session alive
            print(f"jaxllm: {e} (/reset clears the history)", file=sys.stderr)
            continue
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": answer}]
    return 0
