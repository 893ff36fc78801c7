"""The engine in a process of its own (jaxllm.engine.process), as `jaxllm serve` runs it: the same
tokens as `generate`, aborts and the bounded queue as in-process, and an engine process that fails
to start or dies ends everything it held with an error instead of a hang."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from functools import partial

import jax.numpy as jnp
import pytest

import jaxllm
from jaxllm.engine.api import EngineClosed, QueueFull, Request
from jaxllm.engine.process import ProcessEngine
from jaxllm.tools.presets import PRESETS, random_params

PROMPTS = [[3, 17, 9, 41, 5], [7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [11, 12]]


def _tiny():
    return random_params(PRESETS["tiny"], 0, jnp.float32)


def _make(load=_tiny):
    """Run in the engine's process: a small engine (few programs to compile)."""
    from jaxllm.engine.batching import BatchingEngine
    return BatchingEngine(None, load=load, max_slots=2, max_context=64, prefill_chunk=16, prefill_batches=(1,),
                          mixed_prefill=False)


def _failing():
    """An engine whose loop fails at its first step, as a device error would."""
    from jaxllm.engine.batching import BatchingEngine

    class Failing(BatchingEngine):
        def _iterate(self, admitted):
            raise RuntimeError("the device fell over")
    return Failing(None, load=_tiny, max_slots=2, max_context=64, prefill_chunk=16, prefill_batches=(1,),
                   mixed_prefill=False)


def _slow():
    time.sleep(120)


def _refuse():
    raise ValueError("no checkpoint at /nowhere")


def _eventually(value, timeout=10.0):
    """value() once it is truthy, polled for at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not value() and time.monotonic() < deadline:
        time.sleep(0.01)
    return value()


class Collect:
    """Each request's token ids and its final event, gathered from the receiving thread."""

    def __init__(self):
        self.tokens, self.final, self._lock, self.done = {}, {}, threading.Lock(), threading.Condition()

    def on(self, i):
        def on_event(ev):
            with self.done:
                self.tokens.setdefault(i, []).extend(ev.token_ids)
                if ev.finish_reason is not None:
                    self.final[i] = ev
                    self.done.notify_all()
        return on_event

    def wait(self, n, timeout=120):
        with self.done:
            assert self.done.wait_for(lambda: len(self.final) >= n, timeout), f"{len(self.final)} of {n} ended"


@pytest.fixture(scope="module")
def engine():
    e = ProcessEngine(_make, max_queued=2)
    e.start()
    yield e
    e.shutdown(5)


@pytest.mark.slow
def test_requests_get_generates_tokens_and_free_their_rows(engine):
    got = Collect()
    for i, p in enumerate(PROMPTS):
        engine.submit(Request(tuple(p), 12, ignore_eos=True), got.on(i))
    got.wait(len(PROMPTS))
    params = _tiny()
    for i, p in enumerate(PROMPTS):
        expected = jaxllm.generate(params, [p], max_new_tokens=12, eos_token_ids=[]).tokens.tolist()[0]
        assert got.tokens[i] == expected and got.final[i].finish_reason == "length"
    s = engine.stats()
    assert (s["running"], s["waiting"], s["slots_in_use"], s["max_slots"]) == (0, 0, 0, 2)
    assert s["compilations"] == s["warmup_compilations"] > 0  # none after ready


@pytest.mark.slow
def test_the_queue_is_bounded_and_an_abort_ends_a_request(engine):
    got = Collect()
    for i in range(4):  # 2 slots and 2 waiting
        engine.submit(Request((5, 6, 7), 60, ignore_eos=True), got.on(i))
    with pytest.raises(QueueFull, match="2 requests are waiting"):
        engine.submit(Request((5, 6, 7), 60, ignore_eos=True), got.on(9))
    for rid in range(engine._next_id - 4, engine._next_id):
        engine.abort(rid)
    got.wait(4)
    assert {ev.finish_reason for ev in got.final.values()} <= {"abort", "length"}
    assert any(ev.finish_reason == "abort" for ev in got.final.values())
    assert engine.stats()["slots_in_use"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("how", ["killed", "its loop fails"])
def test_an_engine_process_that_dies_or_fails_ends_every_open_request_with_an_error(how):
    killed = how == "killed"
    e = ProcessEngine(_make if killed else _failing)
    failures = []
    e.on_failure = failures.append
    e.start()
    got = Collect()
    for i in range(3):
        e.submit(Request((5, 6, 7), 60, ignore_eos=True), got.on(i))
    if killed:
        os.kill(e._process.pid, signal.SIGKILL)
    got.wait(3)
    message = (f"the engine process exited (exit code {-signal.SIGKILL})" if killed
               else "RuntimeError: the device fell over")
    assert [(ev.finish_reason, ev.error) for ev in got.final.values()] == [("error", message)] * 3
    assert _eventually(lambda: failures) == [message] and not e.ready  # on_failure after the events
    with pytest.raises(EngineClosed, match=re.escape(message)):
        e.submit(Request((5,), 2), got.on(9))
    e.shutdown(5)  # returns: nothing left to wait for; a child still running ends once the parent stops listening
    assert e._process.exitcode == (-signal.SIGKILL if killed else 0)


def test_a_load_error_in_the_engine_process_is_raised_by_start():
    e = ProcessEngine(partial(_make, _refuse))
    with pytest.raises(ValueError, match="no checkpoint at /nowhere"):
        e.start()
    assert not e.ready and e._process.exitcode == 0
    with pytest.raises(EngineClosed):
        e.submit(Request((5,), 2), lambda ev: None)


def test_serve_leaves_the_device_to_the_engine_process():
    """`jaxllm serve`'s own process builds its app without touching a device (a GPU's memory is
    the engine process's); here, up to the point where uvicorn would start serving."""
    code = ("import sys, uvicorn\n"
            "from jax._src import xla_bridge\n"
            "uvicorn.Server.run = lambda self, *a, **k: print('backends', xla_bridge.backends_are_initialized())\n"
            "from jaxllm.cli import main\n"
            "main(['serve', '--port', '0', '--max-context', '64'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "backends False" in out.stdout


def test_shutdown_while_the_engine_process_starts_stops_it_at_once():
    """SIGTERM during a cold start (minutes of compilation on a GPU) need not wait for it."""
    e = ProcessEngine(partial(_make, _slow))
    errors = []

    def start():
        try:
            e.start()
        except Exception as x:
            errors.append(x)
    starter = threading.Thread(target=start)
    starter.start()
    time.sleep(1.0)
    began = time.monotonic()
    e.shutdown(30)
    starter.join(30)
    assert time.monotonic() - began < 10 and not e._process.is_alive()
    assert [type(x) for x in errors] == [EngineClosed] and not e.ready
