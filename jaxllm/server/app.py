"""The OpenAI-compatible HTTP app over an engine (jaxllm.engine.api): FastAPI routes, SSE, errors.

/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics. Each request becomes a
`Job` (protocol.py), one engine request per choice. Events come back on the engine's thread, one
per running row a step; an `_Inbox` hands each step's burst to this app's asyncio loop in one
wakeup (`loop.call_soon_threadsafe` once, not once a token), and each HTTP request's stream writes
what its events made since it last ran in one send. Text is made here (Detokenizer, StopMatcher),
never on the engine thread; a chunk's JSON is two pre-built fragments around the new text. A client that
goes away (a streaming one: Starlette cancels the body; a non-streaming one: a disconnect listener
races the handler, as vLLM's `with_cancellation` does) has its engine requests aborted.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import json
import logging
import sys
import threading
import time
import uuid
from contextlib import asynccontextmanager
from functools import partial
from typing import Callable, NamedTuple

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from jaxllm.engine.api import EngineClosed, Event, QueueFull
from jaxllm.server.metrics import Metrics
from jaxllm.server.protocol import APIError, Job, Limits, chat_job, completion_job
from jaxllm.text.detokenize import Detokenizer, StopMatcher

_log = logging.getLogger("uvicorn.error")  # uvicorn's own lines: `jaxllm serve` prints them

RETRY_AFTER_S = 1  # what a 429 asks the client to wait
SWITCH_INTERVAL_S = 0.0005  # the longest the engine thread waits for the interpreter lock


class ServerState:
    """What the routes share: the engine, the checks' limits, the metrics and the phase
    (loading -> ready -> draining, or failed)."""

    def __init__(self, engine, tokenizer, model: str, api_key: str | None, max_n: int,
                 eos_token_ids=(), on_fatal: Callable[[str], None] | None = None):
        self.engine, self.tokenizer, self.model = engine, tokenizer, model
        self.key_digest = hashlib.sha256(api_key.encode()).digest() if api_key else None
        self.max_n, self.eos = max_n, tuple(eos_token_ids)
        self.on_fatal = on_fatal
        self.metrics = Metrics(engine)
        self.phase = "loading"
        self.progress: str | None = None  # the engine's start, in its words (/health while loading)
        self.failure: str | None = None
        self.limits: Limits | None = None
        self.created = int(time.time())
        self._started = time.monotonic()  # `created` is whole seconds (OpenAI's field)
        self._inbox: _Inbox | None = None

    def inbox_of(self, loop: asyncio.AbstractEventLoop) -> "_Inbox":
        """The inbox of the loop the app runs on (one loop for the app's life)."""
        if self._inbox is None or self._inbox.loop is not loop:
            self._inbox = _Inbox(loop)
        return self._inbox

    def became_ready(self) -> None:
        self.limits = Limits(self.model, self.tokenizer, self.engine.max_context, self.max_n, self.eos)
        if self.phase == "loading":
            self.phase = "ready"
            _log.info("jaxllm: ready in %.1f s", time.monotonic() - self._started)

    def fail(self, message: str) -> None:
        if self.phase == "failed":
            return
        self.phase, self.failure = "failed", message
        if self.on_fatal is not None:
            self.on_fatal(message)


def _error(e: APIError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 429 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def _authorize(state: ServerState, request: HTTPRequest) -> None:
    if state.key_digest is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
            hashlib.sha256(key.strip().encode()).digest(), state.key_digest):
        raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer KEY'",
                       None, "invalid_api_key")


async def _body(request: HTTPRequest):
    raw = await request.body()
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", "body") from None


class _Inbox:
    """Engine events on their way to the loop: the engine thread appends, and the first event of
    a burst (a step's rows) schedules the one callback that hands them all over. Appends and the
    flag are single bytecode operations, safe without a lock under the interpreter lock; a burst
    the callback has begun draining is drained to the end, or schedules the next callback."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._events: collections.deque = collections.deque()
        self._scheduled = False

    def post(self, run: "_Run", i: int, ev: Event) -> None:
        self._events.append((run, i, ev))
        if not self._scheduled:
            self._scheduled = True
            try:
                self.loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the loop is closed: the server is gone
                pass

    def _drain(self) -> None:
        self._scheduled = False
        events = self._events
        while events:
            run, i, ev = events.popleft()
            run.receive(i, ev)


class _Choice:
    """One choice's text and counts, fed engine events in order."""

    def __init__(self, index: int, job: Job, tokenizer, t0: float):
        self.index, self.t0 = index, t0
        self.detok = Detokenizer(tokenizer)
        self.stop = StopMatcher(job.stops)
        self.tokens = 0
        self.finish: str | None = None
        self.error: str | None = None
        self.text: list[str] = []
        self.logprobs: list = []  # TokenLogprob of each token shown
        self.chars = 0  # of text shown (completions' logprobs give offsets)
        self.fragments: tuple[str, str] | None = None  # a text-only chunk's SSE event around its text
        self.t_first: float | None = None

    def feed(self, ev: Event) -> tuple[str, list]:
        """(new text, new TokenLogprobs) of an event; sets `finish` at the choice's end."""
        if ev.token_ids and self.t_first is None:
            self.t_first = time.perf_counter()
        if ev.finish_reason is None and not ev.logprobs and len(ev.token_ids) == 1:
            # a running step's one token: most events, so the short way
            self.tokens += 1
            text = self.stop.push(self.detok.push(ev.token_ids[0]))
            if self.stop.stopped:
                self.finish = "stop"
            self.text.append(text)
            self.chars += len(text)
            return text, []
        ids, lps = list(ev.token_ids), list(ev.logprobs or [])
        if ev.finish_reason == "stop" and ids:  # the stop token itself is counted, not shown
            ids, lps = ids[:-1], lps[:len(ids) - 1]
            self.tokens += 1
        out, shown = [], []
        for j, t in enumerate(ids):
            self.tokens += 1  # up to the token that completes a stop string, none after it
            out.append(self.stop.push(self.detok.push(t)))
            if j < len(lps):
                shown.append(lps[j])
            if self.stop.stopped:
                self.finish = "stop"
                break
        if ev.finish_reason is not None and self.finish is None:
            out.append(self.stop.push(self.detok.flush()))
            out.append(self.stop.flush())
            self.finish = "stop" if self.stop.stopped else ev.finish_reason
            self.error = ev.error
        text = "".join(out)
        self.text.append(text)
        self.chars += len(text)
        self.logprobs += shown
        return text, shown

    def observe(self, metrics: Metrics) -> None:
        now = time.perf_counter()
        metrics.generation_tokens.inc(self.tokens)
        if self.finish in ("stop", "length"):
            metrics.success.labels(self.finish).inc()
            metrics.e2e.observe(now - self.t0)
            if self.t_first is not None:
                metrics.ttft.observe(self.t_first - self.t0)
                if self.tokens > 1:
                    metrics.tpot.observe((now - self.t_first) / (self.tokens - 1))


def _token_text(tok, token_id: int) -> str:
    return tok.decode([token_id], False)


def _chat_logprobs(tok, lps: list) -> dict:
    def entry(t, p):
        s = _token_text(tok, t)
        return {"token": s, "logprob": p, "bytes": list(s.encode("utf-8"))}
    return {"content": [dict(entry(x.token_id, x.logprob), top_logprobs=[entry(t, p) for t, p in x.top])
                        for x in lps]}


def _completion_logprobs(tok, lps: list, offset: int) -> dict:
    tokens = [_token_text(tok, x.token_id) for x in lps]
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": [x.logprob for x in lps],
            "top_logprobs": [{_token_text(tok, t): p for t, p in x.top} for x in lps],
            "text_offset": offsets}


class _Delta(NamedTuple):
    """What one event added to a choice, as it was then (a take holds several events of a choice
    when its stream fell behind: only the last may carry the finish)."""

    choice: _Choice
    text: str
    logprobs: list  # TokenLogprob of the tokens shown
    finish: str | None
    offset: int  # characters of the choice's text before this text


class _Run:
    """One HTTP request's engine requests: submit, events in order, abort what is left."""

    def __init__(self, state: ServerState, job: Job):
        self.state, self.job = state, job
        self.events: list = []  # (choice index, Event) received and not yet taken
        self._wake: asyncio.Future | None = None
        self.t0 = time.perf_counter()
        self.choices = [_Choice(i, job, state.tokenizer, self.t0) for i in range(len(job.requests))]
        self.open = len(self.choices)  # choices not finished
        self.rids: list[int] = []
        self.id = ("chatcmpl-" if job.kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def submit(self) -> None:
        if self.state.phase != "ready":
            raise APIError(503, f"the server is {self.state.phase}" if self.state.phase != "failed" else
                           f"the engine failed: {self.state.failure}", None, "service_unavailable")
        inbox = self.state.inbox_of(asyncio.get_running_loop())
        engine = self.state.engine
        try:
            for i, r in enumerate(self.job.requests):
                self.rids.append(engine.submit(r, partial(inbox.post, self, i)))
        except QueueFull as e:
            self.abort()
            self.state.metrics.rejected.inc()
            raise APIError(429, f"the server is busy: {e}; retry later", None, "queue_full") from None
        except ValueError as e:  # what the engine itself refuses (protocol.py checks it first)
            self.abort()
            raise APIError(400, str(e), None, None) from None
        except EngineClosed as e:
            self.abort()
            raise APIError(503, f"the server is not accepting requests: {e}", None, "service_unavailable") \
                from None
        self.state.metrics.prompt_tokens.inc(len(self.job.prompt_ids))

    def receive(self, i: int, ev: Event) -> None:
        """On the loop: an event of choice i."""
        self.events.append((i, ev))
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def done(self) -> bool:
        return self.open == 0

    async def take(self) -> list[_Delta]:
        """What each event come since the last take (at least one) added to its choice; aborts a
        choice that a stop string ended."""
        while not self.events:
            self._wake = asyncio.get_running_loop().create_future()
            await self._wake
        events, self.events = self.events, []
        out = []
        for i, ev in events:
            c = self.choices[i]
            if c.finish is not None:
                continue  # events after a stop string matched (the abort is on its way)
            text, lps = c.feed(ev)
            if c.finish is not None:
                self.open -= 1
                if ev.finish_reason is None:  # a stop string: the engine still runs it
                    self.state.engine.abort(self.rids[i])
                c.observe(self.state.metrics)
            out.append(_Delta(c, text, lps, c.finish, c.chars - len(text)))
        return out

    def abort(self) -> bool:
        """Abort every choice not finished (the client left, or submit failed part way); whether
        there was one."""
        left = [rid for rid, c in zip(self.rids, self.choices) if c.finish is None]
        for rid in left:
            self.state.engine.abort(rid)
        return bool(left)

    def usage(self) -> dict:
        prompt, completion = len(self.job.prompt_ids), sum(c.tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _chunk(run: _Run, c: _Choice, text: str, lps: list, first: bool, finish: str | None, offset: int) -> str:
    """One SSE event of a stream: choice c's new text (and logprobs) at character `offset`,
    `finish` its finish_reason."""
    tok, job = run.state.tokenizer, run.job
    if job.kind == "chat":
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        choice = {"index": c.index, "delta": delta,
                  "logprobs": _chat_logprobs(tok, lps) if job.logprobs and lps else None,
                  "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": c.index, "text": text,
                  "logprobs": _completion_logprobs(tok, lps, offset) if job.logprobs else None,
                  "finish_reason": finish}
        obj = "text_completion"
    chunk = {"id": run.id, "object": obj, "created": run.created, "model": job.model, "choices": [choice]}
    if job.include_usage:
        chunk["usage"] = None
    return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"


_TEXT = "<jaxllm: the text goes here>"


def _stream_chunk(run: _Run, d: _Delta) -> str:
    c = d.choice
    if d.logprobs or run.job.logprobs or d.finish is not None or not d.text:
        return _chunk(run, c, d.text, d.logprobs, False, d.finish, d.offset)
    # Most chunks: a running choice's new text and nothing else. Its event is built once as the
    # text's two sides, so a token costs one json.dumps of its text.
    if c.fragments is None:
        head, _, tail = _chunk(run, c, _TEXT, [], False, None, 0).partition(json.dumps(_TEXT))
        c.fragments = head, tail
    head, tail = c.fragments
    return head + json.dumps(d.text, ensure_ascii=False) + tail


async def _stream(run: _Run):
    job = run.job
    if job.kind == "chat":
        yield "".join(_chunk(run, c, "", [], True, None, 0) for c in run.choices)
    while not run.done():
        out, failed = [], False
        for d in await run.take():
            if d.finish == "error":
                # after the headers went out, an error is an SSE event (openai-python raises on it)
                err = APIError(500, f"the engine failed: {d.choice.error}", None, "engine_error")
                out.append(f"data: {json.dumps(err.body())}\n\n")
                failed = True
                break
            if d.text or d.logprobs or d.finish is not None:
                out.append(_stream_chunk(run, d))
        if out:  # what one engine step made, or several when this stream fell behind: one send
            yield "".join(out)
        if failed:
            break
    else:
        if job.include_usage:
            chunk = {"id": run.id, "object": "chat.completion.chunk" if job.kind == "chat" else
                     "text_completion", "created": run.created, "model": job.model, "choices": [],
                     "usage": run.usage()}
            yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"


class _SSE(Response):
    """The stream of a run as a bare ASGI response (Starlette's StreamingResponse adds a task
    group a request and a type check and encode a chunk): its body is raced against the client's
    disconnect, and its unfinished choices are aborted however it ends, a client gone mid-stream
    or before the first chunk."""

    HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]

    def __init__(self, run: _Run):
        self.run, self.status_code, self.background = run, 200, None
        self.raw_headers = list(self.HEADERS)

    async def _body(self, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        async for text in _stream(self.run):
            await send({"type": "http.response.body", "body": text.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope, receive, send) -> None:
        body = asyncio.ensure_future(self._body(send))
        gone = asyncio.ensure_future(_until_disconnect(receive))
        try:
            await asyncio.wait((body, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (body, gone):
                task.cancel()
            if self.run.abort():
                self.run.state.metrics.aborted.inc()
        if body.done() and not body.cancelled() and body.exception() is not None:
            raise body.exception()


async def _whole(run: _Run) -> dict:
    while not run.done():
        for d in await run.take():
            if d.finish == "error":
                raise APIError(500, f"the engine failed: {d.choice.error}", None, "engine_error")
    tok, job = run.state.tokenizer, run.job
    choices = []
    for c in run.choices:
        text = "".join(c.text)
        if job.kind == "chat":
            choices.append({"index": c.index, "message": {"role": "assistant", "content": text},
                            "logprobs": _chat_logprobs(tok, c.logprobs) if job.logprobs else None,
                            "finish_reason": c.finish})
        else:
            choices.append({"index": c.index, "text": text,
                            "logprobs": _completion_logprobs(tok, c.logprobs, 0) if job.logprobs else None,
                            "finish_reason": c.finish})
    return {"id": run.id, "object": "chat.completion" if job.kind == "chat" else "text_completion",
            "created": run.created, "model": job.model, "choices": choices, "usage": run.usage()}


async def _until_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _serve(state: ServerState, request: HTTPRequest, make_job) -> Response:
    _authorize(state, request)
    data = await _body(request)
    if state.limits is None:
        raise APIError(503, f"the server is {state.phase}", None, "service_unavailable")
    run = _Run(state, make_job(data, state.limits))
    run.submit()
    if run.job.stream:
        return _SSE(run)
    # Nothing tells a non-streaming handler that its client left: race it against the disconnect.
    answer = asyncio.ensure_future(_whole(run))
    gone = asyncio.ensure_future(_until_disconnect(request.receive))
    try:
        await asyncio.wait((answer, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not answer.done():
            answer.cancel()
            if run.abort():
                state.metrics.aborted.inc()
    if not answer.done():
        return Response(status_code=499)  # the client is gone: no one reads it
    return JSONResponse(answer.result())


def create_app(engine, tokenizer, model: str, *, api_key: str | None = None, max_n: int = 8,
               eos_token_ids=(), start_engine: bool = True, shutdown_timeout: float = 5.0,
               on_fatal: Callable[[str], None] | None = None) -> FastAPI:
    """The app serving `engine` under the name `model`. With `start_engine`, the lifespan starts
    the engine in a thread (loading and compiling; /health is 503 until it is ready) and shuts it
    down, aborting what is left after `shutdown_timeout` seconds. `on_fatal(message)` runs on the
    app's loop when the engine fails (the CLI stops the server with a non-zero exit)."""
    state = ServerState(engine, tokenizer, model, api_key, max_n, eos_token_ids, on_fatal)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = asyncio.get_running_loop()
        # This loop's streams and the engine thread share the interpreter lock. When a step's
        # results arrive, the engine thread must get the lock back at once to dispatch the next
        # step; by default it may wait 5 ms for the loop to let go, longer than a decode step.
        switch = sys.getswitchinterval()
        sys.setswitchinterval(min(switch, SWITCH_INTERVAL_S))
        engine.on_failure = lambda message: loop.call_soon_threadsafe(state.fail, message)

        def progress(message: str) -> None:  # a cold start on a GPU compiles for minutes: say so
            state.progress = message
            _log.info("jaxllm: %s", message)
        engine.on_progress = progress

        def start() -> None:
            try:
                if start_engine:
                    engine.start()
            except EngineClosed:  # the server stopped while the engine started: nothing failed
                return
            except BaseException as e:  # a load or compile error: the server cannot serve
                loop.call_soon_threadsafe(state.fail, f"{type(e).__name__}: {e}")
                return
            loop.call_soon_threadsafe(state.became_ready)

        starter = threading.Thread(target=start, name="jaxllm-engine-start", daemon=True)
        starter.start()
        yield
        if state.phase != "failed":
            state.phase = "draining"
        await asyncio.to_thread(engine.shutdown, shutdown_timeout)
        sys.setswitchinterval(switch)

    app = FastAPI(title="jaxllm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.jaxllm = state

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return _error(APIError(400, first.get("msg", "invalid request"), param))

    @app.exception_handler(HTTPException)
    async def _http(request, e: HTTPException):
        return _error(APIError(e.status_code, str(e.detail), None, None))

    @app.get("/health")
    async def health():
        if state.phase == "ready" and engine.ready:
            return Response(status_code=200)
        doing = f" ({state.progress})" if state.phase == "loading" and state.progress else ""
        return JSONResponse(APIError(503, f"the server is {state.phase}{doing}").body(), status_code=503)

    @app.get("/metrics")
    async def metrics():  # off the loop: an engine in its own process answers stats() by a round trip
        text = await asyncio.to_thread(state.metrics.text)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: HTTPRequest):
        _authorize(state, request)
        return {"object": "list", "data": [{"id": model, "object": "model", "created": state.created,
                                            "owned_by": "jaxllm"}]}

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        return await _serve(state, request, completion_job)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        return await _serve(state, request, chat_job)

    return app
