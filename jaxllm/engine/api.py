"""The contract between the HTTP server and an engine that generates tokens (JetStream's engine
API, vLLM's AsyncLLM/EngineCore split, in a few lines).

The server turns HTTP into `Request`s and text; the engine turns `Request`s into token ids. It
knows nothing of HTTP, text, stop strings or SSE:

    engine.start()                        # load and compile everything it will use; then ready
    rid = engine.submit(request, on_event)  # QueueFull when the bounded waiting queue is full
    engine.abort(rid)                      # client gone or stop string matched; idempotent
    engine.stats()                         # running, waiting, slots_in_use, compilations, ...
    engine.shutdown(timeout)               # finish or abort everything, stop the thread

`on_event(event)` runs on the engine's thread (jaxllm.engine.process.ProcessEngine's: the thread
that receives the engine process's events), so it must be quick and must not block: the server
appends each event to an inbox, and the first of a step's burst wakes its asyncio loop once with
`loop.call_soon_threadsafe` (no polling). Each step gives each running request one event, so the
calls a step come together, one per row: what a callback costs, 128 rows pay a step. A request gets
events of new token ids until exactly one event with a `finish_reason`:
- "stop": a stop token id (the model's EOS unless `ignore_eos`, or one of `stop_token_ids`) came;
  that token is in the event's `token_ids` (the server does not show it as text);
- "length": `max_tokens` tokens were made;
- "abort": `abort(rid)` or `shutdown` ended it (no tokens after the abort);
- "error": the engine failed; `error` says why. The engine then fails every open request the same
  way, calls `on_failure` (set by its owner before `start`) once, and accepts nothing more.

Seeds: a request's tokens depend only on its prompt, its settings and its seed, never on what else
the engine runs (the key of the token at index i is fold_in(key(seed), i), as in `generate`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Literal, Protocol

FinishReason = Literal["stop", "length", "abort", "error"]
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs


class QueueFull(Exception):
    """`submit` found the bounded waiting queue full: the server answers 429 with Retry-After."""


class EngineClosed(Exception):
    """`submit` after `shutdown` began or after the engine failed: the server answers 503."""


@dataclass(frozen=True)
class Request:
    """One generation: token ids in, up to max_tokens token ids out. The server checks every field
    (jaxllm.server.protocol) before it builds one; the engine trusts them."""

    prompt: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0  # 0 is greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # transformers' meaning, over prompt and output
    presence_penalty: float = 0.0  # OpenAI's meaning, over output tokens
    frequency_penalty: float = 0.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()  # besides the model's EOS ids
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k in 0..20: the chosen token's and the top k

    def replace(self, **changes) -> "Request":
        return dataclasses.replace(self, **changes)


def check_fits(request: Request, max_context: int) -> None:
    """ValueError unless `request` has a prompt and its prompt + max_tokens fit `max_context`: what
    an engine's `submit` checks of a request, the rest being the server's (jaxllm.server.protocol)."""
    if len(request.prompt) + request.max_tokens > max_context:
        raise ValueError(f"prompt of {len(request.prompt)} tokens plus max_tokens={request.max_tokens} "
                         f"is over the context of {max_context} tokens")
    if not request.prompt:
        raise ValueError("the prompt is empty: generation needs at least one token")


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log-probability and the `top` most likely (id, logprob), best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Event:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # one per token id when the request asked
    finish_reason: FinishReason | None = None
    error: str | None = None


OnEvent = Callable[[Event], None]


class Engine(Protocol):
    """What `jaxllm.server` needs of an engine (jaxllm.engine.batching.BatchingEngine)."""

    max_context: int  # prompt + max_tokens of one request, at most
    on_failure: Callable[[str], None] | None  # called once, on the engine thread, if it fails
    # set by its owner before `start`: what start is doing, a line at a time, on start's thread
    on_progress: Callable[[str], None] | None

    @property
    def ready(self) -> bool: ...

    def start(self) -> None: ...

    def submit(self, request: Request, on_event: OnEvent) -> int: ...

    def abort(self, request_id: int) -> None: ...

    def shutdown(self, timeout: float | None = None) -> None: ...

    def stats(self) -> dict: ...
