"""An engine in a process of its own: `ProcessEngine` speaks the server's contract (engine.api) and
runs a `BatchingEngine` in a child process (vLLM's AsyncLLM/EngineCore split).

In one process, the server's per-token work (detokenizing, SSE, a socket write a stream) and the
engine thread's dispatch share the interpreter lock: at 128 streams the server's part is most of a
step's host time, and the device waits for it (docs/performance.md#the-engine-in-a-process-of-its-own).
Here the child owns JAX and the device; the parent, which never touches a device, only sends
requests and aborts and receives each step's events in one message.

    engine = ProcessEngine(partial(make_engine, ...))  # a picklable function that builds the engine
    engine.start()  # spawns the child, which builds, loads and compiles; start's progress comes back

What crosses the pipe: ("submit", rid, request), ("abort", rid), ("stats",), ("shutdown", timeout)
one way; ("progress", line), ("ready", info), ("start_failed", error), ("events", [(rid, token_ids,
finish_reason, error, logprobs), ...]), ("stats", dict), ("failed", message), ("closed",) the other.
The child's waiting queue is not bounded; the parent bounds it (a request is waiting while more
than max_slots are open), so `submit` raises QueueFull at once, as the engine in-process does.
"""

from __future__ import annotations

import collections
import multiprocessing
import pickle
import signal
import threading
from typing import Callable

from jaxllm.engine.api import EngineClosed, Event, OnEvent, QueueFull, Request, check_fits

STATS_WAIT_S = 10.0  # the longest stats() waits for the engine's process to answer


class ProcessEngine:
    """The engine that `make()` builds (a BatchingEngine whose params are loaded by its `load`, so
    nothing large crosses the pipe), run in a spawned child process. `max_queued` requests may wait
    beyond the engine's slots."""

    def __init__(self, make: Callable[[], object], *, max_queued: int = 64):
        if isinstance(max_queued, bool) or not isinstance(max_queued, int) or max_queued < 1:
            raise ValueError(f"max_queued must be a whole number >= 1, got {max_queued!r}")
        self._make, self.max_queued = make, max_queued
        self.max_context: int | None = None
        self.max_slots: int | None = None
        self.info: dict = {}  # once started: max_context, max_slots, device, platform (the child's JAX)
        self.on_failure: Callable[[str], None] | None = None
        self.on_progress: Callable[[str], None] | None = None
        self._lock = threading.Lock()
        self._open: dict[int, OnEvent] = {}  # requests submitted and not yet finished
        self._next_id = 0
        self._phase = "new"  # new -> starting -> ready -> closing -> closed, or failed
        self._failure: str | None = None
        self._stats_reply: collections.deque = collections.deque()
        self._last_stats = dict(running=0, waiting=0, slots_in_use=0, max_slots=None, compilations=0, failed=None)
        self._stats_ready = threading.Condition(self._lock)
        self._process = self._conn = self._receiver = None

    # --- the contract -------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._phase == "ready"

    def start(self) -> None:
        context = multiprocessing.get_context("spawn")  # never fork a process that may hold JAX's threads
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_child, args=(child, self._make), name="jaxllm-engine",
                                        daemon=True)
        self._phase = "starting"
        self._process.start()
        child.close()
        while True:  # start's progress, on start's thread as in-process
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                self._process.join(5)
                if self._phase == "closing":  # shutdown stopped it
                    self._phase = "closed"
                    raise EngineClosed("the engine was shut down while starting") from None
                self._phase = "failed"
                raise RuntimeError(f"the engine process exited while starting "
                                   f"(exit code {self._process.exitcode})") from None
            if message[0] == "progress":
                if self.on_progress is not None:
                    self.on_progress(message[1])
            elif message[0] == "start_failed":
                self._phase = "failed"
                self._process.join(10)
                raise message[1]
            else:  # ready
                self.info = message[1]
                self.max_context, self.max_slots = self.info["max_context"], self.info["max_slots"]
                break
        self._receiver = threading.Thread(target=self._receive, name="jaxllm-engine-events", daemon=True)
        with self._lock:
            if self._phase == "starting":
                self._phase = "ready"
        self._receiver.start()

    def submit(self, request: Request, on_event: OnEvent) -> int:
        with self._lock:
            if self._phase != "ready":
                raise EngineClosed(self._failure or "the engine is not running")
            check_fits(request, self.max_context)
            waiting = len(self._open) - self.max_slots
            if waiting >= self.max_queued:
                raise QueueFull(f"{waiting} requests are waiting, the most this server queues")
            rid = self._next_id
            self._next_id += 1
            self._open[rid] = on_event
            self._conn.send(("submit", rid, request))
        return rid

    def abort(self, request_id: int) -> None:
        with self._lock:
            if request_id in self._open and self._phase in ("ready", "closing"):
                self._conn.send(("abort", request_id))

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop admitting; the child lets open requests finish for `timeout` seconds, aborts what
        is left and exits. While it starts (loading, compiling) there is nothing to finish: it is
        stopped at once, and `start` raises EngineClosed."""
        with self._lock:
            phase = self._phase
            if phase in ("ready", "starting"):
                self._phase = "closing"
            if phase == "ready":
                try:
                    self._conn.send(("shutdown", timeout))
                except OSError:
                    pass
        if phase == "starting":
            self._process.kill()
        if self._receiver is not None:
            self._receiver.join()
        if self._process is not None:
            self._process.join(30)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()

    def stats(self) -> dict:
        """The child engine's stats (a round trip of at most STATS_WAIT_S), or the last known
        with nothing running where it is gone (its counters never go back)."""
        with self._lock:
            live = self._phase in ("ready", "closing")
            if live:
                self._conn.send(("stats",))
                self._stats_ready.wait_for(lambda: self._stats_reply or self._phase not in ("ready", "closing"),
                                           STATS_WAIT_S)
                while self._stats_reply:
                    self._last_stats = self._stats_reply.popleft()
            s = dict(self._last_stats)
            if live:  # requests sent and not yet arrived are waiting too
                s["waiting"] = max(len(self._open) - s["running"], s["waiting"])
            else:
                s.update(running=0, waiting=0, slots_in_use=0, failed=self._failure)
        return s

    # --- the parent's receiving thread --------------------------------------------------------

    def _receive(self) -> None:
        failure = None
        try:
            while True:
                message = self._conn.recv()
                kind = message[0]
                if kind == "events":
                    with self._lock:
                        targets = [(self._open.get(e[0]), e) for e in message[1]]
                        for rid, _, finish, _, _ in message[1]:
                            if finish is not None:
                                self._open.pop(rid, None)
                    for on_event, (_, tokens, finish, error, logprobs) in targets:
                        if on_event is not None:
                            on_event(Event(tokens, logprobs, finish, error))
                elif kind == "stats":
                    with self._lock:
                        self._stats_reply.append(message[1])
                        self._stats_ready.notify_all()
                elif kind == "failed":  # the engine thread died; its requests' errors came first
                    failure = message[1]
                    break
                elif kind == "closed":
                    break
        except (EOFError, OSError):
            if failure is None and self._phase != "closing":
                self._process.join(5)  # its exit code
                failure = f"the engine process exited (exit code {self._process.exitcode})"
        with self._lock:
            left = list(self._open.values())
            self._open.clear()
            self._phase = "failed" if failure is not None else "closed"
            self._failure = failure
            self._stats_ready.notify_all()
        for on_event in left:  # requests the child never finished: it died
            on_event(Event(finish_reason="error", error=failure or "the engine process exited"))
        self._conn.close()  # a child still reading commands ends at this
        if failure is not None and self.on_failure is not None:
            self.on_failure(failure)


def _child(conn, make: Callable[[], object]) -> None:
    """The child process: build and start the engine, then serve the parent's commands on this
    thread while a sender thread ships each step's events in one message."""
    # Ctrl-C reaches the whole process group, and a service manager's SIGTERM may: the parent
    # drains and then says "shutdown"; a parent that dies closes the pipe, which ends this too.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    send_lock = threading.Lock()

    def send(message) -> None:
        with send_lock:
            conn.send(message)

    try:
        engine = make()
        engine.max_queued = 1 << 30  # the parent bounds the waiting queue
        engine.on_progress = lambda line: send(("progress", line))
        engine.start()
    except BaseException as e:  # a load or compile error: the parent's start raises it
        try:
            pickle.dumps(e)
        except Exception:
            e = RuntimeError(f"{type(e).__name__}: {e}")
        send(("start_failed", e))
        return
    outbox: collections.deque = collections.deque()
    wake = threading.Event()
    failed: list[str] = []

    def on_failure(message: str) -> None:
        failed.append(message)
        wake.set()
    engine.on_failure = on_failure

    ids: dict[int, int] = {}  # the parent's request ids -> the engine's, while open

    # On the engine thread: one append, one flag. An event crosses as a tuple: pickling 128
    # Event objects took 125 us a step, their tuples 12.
    def post(rid: int, event: Event) -> None:
        outbox.append((rid, event.token_ids, event.finish_reason, event.error, event.logprobs))
        if event.finish_reason is not None:
            ids.pop(rid, None)
        if not wake.is_set():
            wake.set()

    done = threading.Event()

    def sender() -> None:
        while True:
            wake.wait()
            wake.clear()
            batch = []
            while outbox:
                batch.append(outbox.popleft())
            try:
                if batch:
                    send(("events", batch))
                if failed and not outbox:
                    send(("failed", failed[0]))
                    failed.clear()
            except OSError:  # the parent is gone: the main thread sees it too, and ends
                return
            if done.is_set() and not outbox:
                return

    shipping = threading.Thread(target=sender, name="jaxllm-engine-sender", daemon=True)
    shipping.start()
    import jax  # loaded by the engine already
    send(("ready", dict(max_context=engine.max_context, max_slots=engine.max_slots,
                        device=str(jax.devices()[0]), platform=jax.default_backend())))
    timeout = 0.0
    try:
        while True:
            message = conn.recv()
            kind = message[0]
            if kind == "submit":
                rid = message[1]
                try:
                    ids[rid] = engine.submit(message[2], lambda ev, rid=rid: post(rid, ev))
                except EngineClosed as e:  # it failed since the parent sent this: its reason
                    post(rid, Event(finish_reason="error", error=str(e)))
                except Exception as e:
                    post(rid, Event(finish_reason="error", error=f"{type(e).__name__}: {e}"))
            elif kind == "abort":
                if message[1] in ids:
                    engine.abort(ids[message[1]])
            elif kind == "stats":
                send(("stats", engine.stats()))
            elif kind == "shutdown":
                timeout = message[1]
                break
    except (EOFError, OSError):  # the parent is gone
        timeout = 0.0
    engine.shutdown(timeout)
    done.set()
    wake.set()
    shipping.join()
    try:
        send(("closed",))
    except OSError:  # the parent stopped listening (it saw the engine fail, or it is gone)
        pass
