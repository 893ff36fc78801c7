"""Chat templates: a model's Jinja template rendered as transformers renders it, in a process of
its own.

What this module owns:
- `render_chat_template(template, messages, ...)`: the conversation through the template, always
  in jinja2's `ImmutableSandboxedEnvironment` with transformers' globals (`raise_exception`,
  `strftime_now`, `tojson` without HTML escaping, loop controls, `{% generation %}`): a template
  that comes with a downloaded checkpoint is untrusted code.
- Bounds on the work a template does. The sandbox stops code execution, not runaway work: a loop
  over a loop, a string doubled forty times or `'a'.ljust(10**10)` hangs or exhausts a process.
  The render runs in a child process (this file, run by itself: it imports nothing of jaxllm, so
  it starts in a tenth of a second, once, and then serves every render) under a time limit and a
  memory limit (`RENDER_SECONDS`, `RENDER_MEMORY`), and its text may be at most `RENDER_CHARS`
  long, so the caller never holds more; whatever the template does, the caller gets a
  `ChatTemplateError` that says which limit it hit, and the next render a fresh process. Inside
  it, budgets on `range()` items and on `*` and `**` name the common runaways at once. Renders
  from several threads run at once, up to `RENDER_PROCESSES` children, so a runaway holds up only
  its own caller; a forked process starts its own children; a child ends with its parent.

This file imports only the standard library and jinja2, since the child loads it alone.
"""

from __future__ import annotations

import atexit
import gc
import json
import math
import os
import pickle
import selectors
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache


class ChatTemplateError(ValueError):
    """The chat template failed, refused the conversation, or tried something the sandbox forbids."""


# Budgets that name the common runaways at once, before the render process's limits would: jinja
# caps one range() at 100,000 items, but not loops nested over several, nor `'a' * 10**10` or
# `2 ** 10**7`. A real template needs a few hundred range items and small numbers.
_TEMPLATE_MAX_ITEMS = 1_000_000  # range() items over one render, and items of one repeated str/list
_TEMPLATE_MAX_DIGITS = 4300  # digits of an int from * or ** (Python's own limit for printing one)
_range_budget: ContextVar[list[int]] = ContextVar("_range_budget")  # [items left], set per render


def _alias_reasoning(message: dict) -> dict:
    """transformers fills `reasoning_content` and `thinking` from any of the names a message's
    reasoning comes under, since templates read one or the other."""
    for key in ("reasoning_content", "thinking", "reasoning"):
        if message.get(key) is not None:
            return {"thinking": message[key], **message, "reasoning_content": message[key]}
    return message


def _plain(value):
    """Template inputs rebuilt from plain JSON types: rich objects carry methods the sandbox does not
    know to be dangerous (as transformers' `_plain_template_data`)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if hasattr(value, "tolist") and callable(value.tolist):  # numpy and jax arrays and scalars
        return _plain(value.tolist())
    return f"<{type(value).__name__}>"


@lru_cache(maxsize=16)
def _compile(template: str):
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

    class GenerationTag(Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; it
        renders its body unchanged (templates that use it must still parse)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters, which chat formats do not want
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    def budget_range(*args):
        items = safe_range(*args)  # jinja's cap on one range() still holds
        left = _range_budget.get()
        left[0] -= len(items)
        if left[0] < 0:
            raise ChatTemplateError(f"the chat template loops over more than {_TEMPLATE_MAX_ITEMS} "
                                    "range() items in total")
        return items

    class TemplateEnvironment(ImmutableSandboxedEnvironment):
        """The immutable sandbox, refusing `*` and `**` results too large to build."""

        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context, op, left, right):
            ints = isinstance(left, int) and isinstance(right, int)
            if op == "*":
                seq, times = (left, right) if isinstance(right, int) else (right, left)
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int) \
                        and len(seq) * times > _TEMPLATE_MAX_ITEMS:
                    raise ChatTemplateError(f"the chat template repeats a {type(seq).__name__} to "
                                            f"{len(seq) * times} items (the limit is {_TEMPLATE_MAX_ITEMS})")
                huge = ints and (abs(left).bit_length() + abs(right).bit_length()) * math.log10(2) \
                    > _TEMPLATE_MAX_DIGITS
            else:  # ** (right compared, not multiplied: it can be too big for a float)
                huge = ints and abs(left) > 1 and right > _TEMPLATE_MAX_DIGITS / math.log10(abs(left))
            if huge:
                raise ChatTemplateError(f"the chat template computes an integer of over "
                                        f"{_TEMPLATE_MAX_DIGITS} digits with {op}")
            return super().call_binop(context, op, left, right)

    class TemplateDict:
        """`dict(...)` for templates without exposing the `dict` type itself."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """`namespace()` that refuses underscore attributes, the road to CPython internals."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot set underscore attributes on a namespace ({name!r})")

    env = TemplateEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.globals["range"] = budget_range
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(template)


RENDER_SECONDS = 10.0  # one render's time limit, its transfers included; real ones take milliseconds
RENDER_MEMORY = 2 << 30  # the child's address space: ample for any real conversation
RENDER_CHARS = 32 << 20  # the longest text a render returns: far past any model's context
RENDER_PROCESSES = 4  # renders under way at once, from several threads, each in a child of its own
_CACHED_TEMPLATE_CHARS = 1 << 20  # longer templates are compiled afresh: the cache would fill the child
_OUT_OF_MEMORY = (f"the chat template failed: MemoryError: it needed more than the {RENDER_MEMORY >> 20} "
                  "MB a render may use")


def render_chat_template(template: str, messages: list[Mapping], *, add_generation_prompt: bool = True,
                         tools: list[dict] | None = None, documents: list[dict] | None = None,
                         **context) -> str:
    """Render a chat template in jinja2's immutable sandbox, with transformers' globals and inputs,
    in a render process, within `RENDER_SECONDS`, `RENDER_MEMORY` and `RENDER_CHARS`. Renders
    from several threads run at once, each in a process of its own (up to `RENDER_PROCESSES`)."""
    if not isinstance(template, str):
        raise TypeError(f"a chat template is a string, not {type(template).__name__}")
    try:
        inputs = _plain((list(messages), tools, documents, add_generation_prompt, context))
    except RecursionError:
        raise ChatTemplateError("the conversation is nested too deeply to render") from None
    except Exception as e:  # noqa: BLE001 - the caller's objects: their methods may raise anything
        raise ChatTemplateError(f"the conversation holds a value that cannot be read: "
                                f"{type(e).__name__}: {e}") from None
    messages, tools, documents, add_generation_prompt, context = inputs
    chat = []
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError(f"chat messages must be dicts, got {message!r}")
        # APIs send `content=None` / `tool_calls=None`; templates handle a missing key, not None
        chat.append(_alias_reasoning({k: v for k, v in message.items() if v is not None}))
    request = dict(template=str.__str__(template), messages=chat, tools=tools, documents=documents,
                   add_generation_prompt=add_generation_prompt, context=context, max_chars=RENDER_CHARS)
    reply = _Worker.render(pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL))
    if "error" in reply:
        raise ChatTemplateError(reply["error"])
    return reply["text"]


def _render(template: str, messages: list[dict], tools, documents, add_generation_prompt: bool,
            context: dict, max_chars: int) -> str:
    """The render itself, in the child: every failure of the template, and a text longer than
    `max_chars` (which the caller would have to hold, then tokenize), a ChatTemplateError."""
    import jinja2

    budget = _range_budget.set([_TEMPLATE_MAX_ITEMS])
    try:
        if len(template) <= _CACHED_TEMPLATE_CHARS:
            text = _compile(template).render(messages=messages, tools=tools, documents=documents,
                                             add_generation_prompt=add_generation_prompt, **context)
        else:
            try:  # compiled afresh, and its environment's reference cycles freed at once
                text = _compile.__wrapped__(template).render(
                    messages=messages, tools=tools, documents=documents,
                    add_generation_prompt=add_generation_prompt, **context)
            finally:
                gc.collect()
        if len(text) > max_chars:
            raise ChatTemplateError(f"the chat template's text is {len(text)} characters long, more than the "
                                    f"{max_chars} a render may return")
        return text
    except ChatTemplateError:
        raise
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template does not parse: {e} (line {e.lineno})") from None
    except jinja2.exceptions.SecurityError as e:
        raise ChatTemplateError(f"the chat template tried an operation the sandbox forbids: {e}") from None
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"the chat template failed: {e}") from None
    except MemoryError:
        raise ChatTemplateError(_OUT_OF_MEMORY) from None
    except Exception as e:  # untrusted code: RecursionError, TypeError, OverflowError...
        raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None
    finally:
        _range_budget.reset(budget)


# --- the render process ------------------------------------------------------------------------
# Requests go to the child's stdin, pickled (the child unpickles only what its parent sent);
# replies come back on a pipe of their own, as JSON (the parent never unpickles what a template
# made, and whatever else writes to the child's stdout cannot get in their way). One frame each
# way: 8 bytes of length, then the bytes. Every transfer is bounded by the render's deadline.

class _ProcessEnded(Exception):
    """The render process closed its end, or sent what is not a reply."""


class _Worker:
    """A child process that renders. Started as renders need them, up to `RENDER_PROCESSES` at
    once, and kept for the next render. One that ran out of time or memory, or was interrupted
    mid-exchange, is stopped, so the next render gets a fresh one; a forked process starts its own."""

    _lock = threading.Lock()  # guards _idle and _all
    _idle: list[_Worker] = []  # children waiting for a render
    _all: set[_Worker] = set()  # every child not yet stopped, idle or rendering
    _turns = threading.BoundedSemaphore(RENDER_PROCESSES)

    def __init__(self):
        if not sys.executable:
            raise ChatTemplateError("the chat template's render process could not be started: this "
                                    "Python does not know its own executable (sys.executable)")
        safe_path = ["-P"] if sys.version_info >= (3, 11) else []  # no working directory on sys.path
        self.stopped = False  # set by stop, or by stop_all while it renders: never put back as idle
        replies, reply_end = os.pipe()
        try:  # whatever stops this (Ctrl-C included), the pipes and the process are not left behind
            try:
                load = ("import importlib.util as u; s = u.spec_from_file_location('jaxllm_chat_template', "
                        f"{__file__!r}); m = u.module_from_spec(s); s.loader.exec_module(m); m._serve({reply_end})")
                self.process = subprocess.Popen([sys.executable, *safe_path, "-c", load],
                                                stdin=subprocess.PIPE, pass_fds=(reply_end,))
            finally:
                os.close(reply_end)
            self.replies, self.requests = replies, self.process.stdin.fileno()
            os.set_blocking(self.requests, False)
            for fd in (self.replies, self.requests):
                _widen_pipe(fd)
        except BaseException as e:
            os.close(replies)
            if hasattr(self, "process"):
                self.process.kill()
                self.process.stdin.close()
                self.process.wait()
            if isinstance(e, (OSError, ValueError)):
                raise ChatTemplateError(f"the chat template's render process could not be started: {e}") from None
            raise
        with _Worker._lock:
            _Worker._all.add(self)

    @classmethod
    def render(cls, payload: bytes) -> dict:
        with cls._turns:  # a render waits here only while RENDER_PROCESSES others are under way
            worker = None
            try:  # an idle child, or a new one (whose failure to start is the caller's error)
                with cls._lock:
                    worker = cls._idle.pop() if cls._idle else None
                if worker is None or worker.process.poll() is not None:
                    if worker is not None:
                        worker.stop()
                    worker = None
                    worker = cls()
            except BaseException:  # Ctrl-C with a child popped: it is not left out of the pool running
                if worker is not None:
                    worker.stop()
                raise
            try:
                deadline = time.monotonic() + RENDER_SECONDS
                worker.send(payload, deadline)
                (size,) = struct.unpack("<Q", worker.receive(8, deadline))
                reply = json.loads(worker.receive(size, deadline))
                if not (isinstance(reply, dict) and isinstance(reply.get("text", reply.get("error")), str)):
                    raise _ProcessEnded
            except TimeoutError:
                worker.stop()
                raise ChatTemplateError(f"the chat template ran for more than {RENDER_SECONDS:g} s, "
                                        "the limit of one render") from None
            except (_ProcessEnded, ValueError, struct.error, OSError):  # EOF, a broken pipe, not JSON
                code = worker.stop()
                how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                raise ChatTemplateError(f"the chat template's render process ended ({how}) without a "
                                        "reply") from None
            except BaseException:  # Ctrl-C or anything else mid-exchange: the stream is out of step
                worker.stop()
                raise
            with cls._lock:
                idle = not (reply.get("ended") or worker.stopped)  # out of memory, or stop_all's
                if idle:
                    cls._idle.append(worker)
            if not idle:
                worker.stop()
            return reply

    def send(self, payload: bytes, deadline: float) -> None:
        data = memoryview(struct.pack("<Q", len(payload)) + payload)
        with selectors.DefaultSelector() as ready:
            ready.register(self.requests, selectors.EVENT_WRITE)
            while data:
                _wait(ready, deadline)
                try:
                    data = data[os.write(self.requests, data[:1 << 20]):]
                except BlockingIOError:
                    continue

    def receive(self, size: int, deadline: float) -> bytes:
        got = bytearray()
        with selectors.DefaultSelector() as ready:
            ready.register(self.replies, selectors.EVENT_READ)
            while len(got) < size:
                _wait(ready, deadline)
                chunk = os.read(self.replies, min(size - len(got), 1 << 24))
                if not chunk:
                    raise _ProcessEnded
                got += chunk
        return bytes(got)

    def stop(self) -> int | None:
        """Stop this child and give its exit code."""
        with _Worker._lock:
            self.stopped = True
            _Worker._all.discard(self)
        self.process.kill()
        for close in (self.process.stdin.close, lambda: os.close(self.replies)):
            try:
                close()
            except OSError:
                pass
        return self.process.wait()

    @classmethod
    def stop_all(cls) -> None:
        """Stop every child: the idle ones here; the rendering ones are killed, and the thread that
        renders with each closes its pipes (closed under it, a descriptor could be reused by a file
        opened meanwhile), its render failing with a ChatTemplateError that names the end."""
        with cls._lock:
            idle, cls._idle = cls._idle, []
            rendering = cls._all.difference(idle)
            for worker in rendering:
                worker.stopped = True
        for worker in idle:
            worker.stop()
        for worker in rendering:
            worker.process.kill()


def _after_fork_in_child() -> None:
    """The parent's children, lock (perhaps held by a thread that did not come along) and turns
    stay its own: a forked process talking to its parent's child would garble both's renders."""
    _Worker._lock = threading.Lock()
    _Worker._idle, _Worker._all = [], set()
    _Worker._turns = threading.BoundedSemaphore(RENDER_PROCESSES)


atexit.register(_Worker.stop_all)  # a child still running at exit is killed, not left to see EOF
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _wait(ready: selectors.BaseSelector, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0 or not ready.select(None if math.isinf(left) else left):
        raise TimeoutError


def _widen_pipe(fd: int) -> None:
    """A 1 MiB pipe where Linux allows it (64 KiB by default): a long prompt crosses in fewer trips."""
    try:
        import fcntl
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, 1 << 20)
    except (ImportError, AttributeError, OSError):
        pass


def _serve(reply_fd: int) -> None:
    """The child's loop: a request in, a reply out, until the parent closes the pipe. After a
    render that ran out of memory it ends, so that the next render has a fresh process."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops this process
    try:
        import resource
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = RENDER_MEMORY if hard == resource.RLIM_INFINITY else min(RENDER_MEMORY, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ImportError, ValueError, OSError):  # not on this platform: the time limit still holds
        pass
    threading.Thread(target=_end_with_parent, args=(os.getppid(),), daemon=True).start()
    inp, out = sys.stdin.buffer, os.fdopen(reply_fd, "wb")
    while len(header := inp.read(8)) == 8:
        try:
            reply = {"text": _render(**pickle.loads(inp.read(struct.unpack("<Q", header)[0])))}
        except ChatTemplateError as e:
            reply = {"error": str(e)}
        except MemoryError:  # reading the request
            reply = {"error": _OUT_OF_MEMORY}
        except BaseException as e:  # noqa: BLE001 - reported, never a traceback on the caller's stderr
            reply = {"error": f"the chat template failed: {type(e).__name__}: {e}"}
        try:
            data = json.dumps(reply).encode()  # ASCII: lone surrogates survive the trip
        except MemoryError:
            reply = {"error": f"the chat template's text is too large to send back ({_OUT_OF_MEMORY})"}
            data = json.dumps(reply).encode()
        ending = _OUT_OF_MEMORY in reply.get("error", "")
        if ending:
            data = data[:-1] + b', "ended": true}'
        out.write(struct.pack("<Q", len(data)) + data)
        out.flush()
        if ending:
            return


def _end_with_parent(parent: int) -> None:
    """A child whose parent died (killed mid-render, say) must not render on for ever."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)
