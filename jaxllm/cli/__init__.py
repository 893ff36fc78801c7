"""The `jaxllm` command line: `generate` and `chat`, and the registry other subcommands join.

Every subcommand is one `add_NAME(subparsers)` function that builds its parser and sets
`run=function(args) -> exit code`; `SUBCOMMANDS` lists them in the order `--help` shows. To add
one, write its `add_` function (in its own module under cli/) and append it to `SUBCOMMANDS`. The shared flags (`add_model_args`,
`add_sampling_args`, `add_system_arg`, `add_trace_arg`) and `load_model` / `sampling_kwargs` keep
the flags and their meaning the same everywhere.

Exit codes: 0 done, 2 bad input (a flag value the library refuses, a missing model), 130 Ctrl-C,
143 SIGTERM (both after cleaning up what the command was writing).
Input errors are one line on stderr, never a traceback; a traceback means a bug in jaxllm.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

from jaxllm.cli.common import Terminated, UsageError, say, terminate_as_exception
from jaxllm.cli.convert import add_convert
from jaxllm.cli.generate import add_chat, add_generate
from jaxllm.cli.perplexity import add_perplexity
from jaxllm.cli.roofline import add_roofline
from jaxllm.cli.serve import add_serve


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
    terminate_as_exception()
    try:
        return args.run(args)
    except (UsageError, ValueError, FileNotFoundError) as e:
        # Bad input, as the library names it: one line, no traceback.
        print(f"jaxllm {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # its clean-up done on the way here
        say(f"jaxllm {args.command}: {'terminated' if isinstance(e, Terminated) else 'interrupted'}")
        return 143 if isinstance(e, Terminated) else 130
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
