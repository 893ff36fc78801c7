"""`jaxllm serve`: the OpenAI-compatible server on uvicorn, in the shape of jaxllm.cli.SUBCOMMANDS.

Exit codes: 0 after SIGTERM or Ctrl-C (in-flight requests finished, or aborted after
--shutdown-timeout), 1 when the engine failed (loading, compiling or serving), 2 for bad flags.
"""

from __future__ import annotations

import argparse
import signal
import sys
from functools import partial
from pathlib import Path


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


def add_serve(subparsers) -> None:
    from jaxllm.checks import argtype
    from jaxllm.cli.common import add_draft_quant_arg, add_model_args, positive_int

    p = subparsers.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)",
        description="Serve the model over HTTP with OpenAI's API: /v1/completions, "
                    "/v1/chat/completions, /v1/models, /health (503 until ready), /metrics "
                    "(Prometheus). SIGTERM stops admitting and drains.")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=argtype(0, 65535), default=8000, help="port to listen on (default: 8000)")
    p.add_argument("--max-slots", type=positive_int, default=None, metavar="N",
                   help="requests generated at once, each a row of one preallocated KV cache of "
                        "--max-context slots (default: 64 on a GPU, 8 elsewhere)")
    p.add_argument("--max-context", type=positive_int, default=None, metavar="N",
                   help="prompt + max_tokens of one request, at most (default: the model's context)")
    p.add_argument("--prefill-chunk", type=positive_int, default=512, metavar="N",
                   help="prompts longer than this are prefilled N tokens at a time between decode steps, "
                        "shorter ones batched up to N tokens (a power of two >= 16 or a multiple of 1024; "
                        "default: 512)")
    p.add_argument("--no-mixed-prefill", dest="mixed_prefill", action="store_false",
                   help="prefill every prompt in a call of its own, never inside a decode step: a cold start "
                        "compiles two programs fewer a prompt width (seconds each on a GPU); steps under "
                        "load run a few percent slower")
    p.add_argument("--max-queued", type=positive_int, default=64, metavar="N",
                   help="requests waiting for a slot before more get 429 (default: 64)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/* (/health and /metrics stay open)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model's name in the API (default: the checkpoint's file or directory name)")
    p.add_argument("--speculate", choices=("ngram",), default=None,
                   help="speculative decoding by prompt lookup (drafts from the request's own prompt and "
                        "answer, checked in one step): the same tokens when greedy, the same law when "
                        "sampling; in decode steps of at most JAXLLM_SPEC_MAX_BATCH (4) rows")
    p.add_argument("--draft-model", metavar="PATH", default=None,
                   help="speculative decoding with a smaller checkpoint of the same tokenizer proposing "
                        "the tokens (its own cache of --max-slots rows); the same tokens when greedy, the "
                        "same law when sampling; in decode steps of at most JAXLLM_SPEC_MAX_BATCH_DRAFT (64) rows")
    add_draft_quant_arg(p)
    p.add_argument("--num-speculative", type=argtype(1, 32), default=None, metavar="K",
                   help="drafts a row a step with --speculate or --draft-model (default: 7 for ngram, "
                        "3 for a draft model)")
    p.add_argument("--shutdown-timeout", type=_seconds, default=30.0, metavar="S",
                   help="on SIGTERM, seconds in-flight requests may take before they are aborted "
                        "(default: 30)")
    p.set_defaults(run=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    import jaxllm
    from jaxllm.cli.common import UsageError, _model_path, check_speculative_args
    from jaxllm.io import paths
    from jaxllm.engine.generate import bucket
    from jaxllm.engine.process import ProcessEngine
    from jaxllm.server.app import create_app

    if args.prefill_chunk < 16 or bucket(args.prefill_chunk) != args.prefill_chunk:
        raise UsageError(f"--prefill-chunk must be a power of two >= 16 or a multiple of 1024, "
                         f"got {args.prefill_chunk}")
    check_speculative_args(args)
    if args.draft_model and args.tp > 1:
        raise UsageError("--draft-model runs on one device: it cannot be combined with --tp yet")
    if args.max_context is not None and args.max_context < 2:
        raise UsageError(f"--max-context must be at least 2, got {args.max_context}")
    path = _model_path(args.model)
    tok = jaxllm.load_tokenizer(path)
    name = args.served_model_name or (Path(path).stem if path != paths.default_model_path() else
                                      "SmolLM2-135M-Instruct")
    # The engine runs in a process of its own (jaxllm.engine.process): this one serves HTTP and
    # never touches a device, so the child gets all of its memory.
    engine = ProcessEngine(partial(make_engine, args, tuple(tok.eos_token_ids)), max_queued=args.max_queued)
    failure: list[str] = []

    def on_fatal(message: str) -> None:
        print(f"jaxllm serve: error: the engine failed: {message}", file=sys.stderr)
        failure.append(message)
        server.should_exit = True

    app = create_app(engine, tok, name, api_key=args.api_key, eos_token_ids=tok.eos_token_ids,
                     shutdown_timeout=args.shutdown_timeout, on_fatal=on_fatal)
    state = app.state.jaxllm

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if state.phase in ("loading", "ready"):
                state.phase = "draining"  # new requests on open connections get 503
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info", lifespan="on",
                            timeout_graceful_shutdown=args.shutdown_timeout)
    server = Server(config)
    # uvicorn raises a SIGTERM it handled again once it has drained, through the handler it found;
    # this one ignores it there, so a drained server exits 0 rather than die by the signal.
    signal.signal(signal.SIGTERM, lambda sig, frame: None)
    server.run()
    return 1 if failure or not server.started else 0


def make_engine(args: argparse.Namespace, eos_token_ids: tuple[int, ...]):
    """The serving engine of `args`, built in the engine's process: it loads the model in its
    `start` (the server answers /health with 503 meanwhile); the model's stop ids join
    `eos_token_ids` then (cli.stop_ids)."""
    import jax

    from jaxllm.cli.common import load_draft
    from jaxllm.engine.batching import BatchingEngine

    # A GPU's decode step costs about the same for 1 or 64 rows (it reads the weights once); a CPU's
    # grows with the rows.
    max_slots = args.max_slots or (64 if jax.default_backend() == "gpu" else 8)
    return BatchingEngine(None, load=partial(_load_params, args), eos_token_ids=eos_token_ids,
                          max_slots=max_slots, max_context=args.max_context, max_queued=args.max_queued,
                          prefill_chunk=args.prefill_chunk, mixed_prefill=args.mixed_prefill,
                          speculative=partial(load_draft, args) if args.draft_model else args.speculate,
                          num_speculative=args.num_speculative)


def _load_params(args: argparse.Namespace):
    from jaxllm.cli.common import load_model
    return load_model(args)[0]
