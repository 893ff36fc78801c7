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
  memory limit (`RENDER_SECONDS`, `RENDER_MEMORY`); whatever the template does, the caller gets a
  `ChatTemplateError` that says which limit it hit, and the next render a fresh process. Inside
  it, budgets on `range()` items and on `*` and `**` name the common runaways at once.

This file imports only the standard library and jinja2, since the child loads it alone.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import pickle
import select
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


RENDER_SECONDS = 10.0  # one render's time limit; real templates render in milliseconds
RENDER_MEMORY = 2 << 30  # the child's address space: ample for any real conversation


def render_chat_template(template: str, messages: list[Mapping], *, add_generation_prompt: bool = True,
                         tools: list[dict] | None = None, documents: list[dict] | None = None,
                         **context) -> str:
    """Render a chat template in jinja2's immutable sandbox, with transformers' globals and inputs,
    in the render process, within `RENDER_SECONDS` and `RENDER_MEMORY`."""
    try:
        messages, tools, documents, context = _plain((list(messages), tools, documents, context))
    except RecursionError:
        raise ChatTemplateError("the conversation is nested too deeply to render") from None
    chat = []
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError(f"chat messages must be dicts, got {message!r}")
        # APIs send `content=None` / `tool_calls=None`; templates handle a missing key, not None
        chat.append(_alias_reasoning({k: v for k, v in message.items() if v is not None}))
    request = dict(template=template, messages=chat, tools=tools, documents=documents,
                   add_generation_prompt=add_generation_prompt, context=context)
    reply = _Worker.render(request)
    if "error" in reply:
        raise ChatTemplateError(reply["error"])
    return reply["text"]


def _render(template: str, messages: list[dict], tools, documents, add_generation_prompt: bool,
            context: dict) -> str:
    """The render itself, in the child: every failure of the template a ChatTemplateError."""
    import jinja2

    budget = _range_budget.set([_TEMPLATE_MAX_ITEMS])
    try:
        return _compile(template).render(messages=messages, tools=tools, documents=documents,
                                         add_generation_prompt=add_generation_prompt, **context)
    except ChatTemplateError:
        raise
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template does not parse: {e} (line {e.lineno})") from None
    except jinja2.exceptions.SecurityError as e:
        raise ChatTemplateError(f"the chat template tried an operation the sandbox forbids: {e}") from None
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"the chat template failed: {e}") from None
    except MemoryError:
        raise ChatTemplateError(f"the chat template failed: MemoryError: it needed more than the "
                                f"{RENDER_MEMORY >> 20} MB a render may use") from None
    except Exception as e:  # untrusted code: RecursionError, TypeError, OverflowError...
        raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None
    finally:
        _range_budget.reset(budget)


# --- the render process ------------------------------------------------------------------------
# One frame each way: 8 bytes of length, then the request pickled (the child unpickles only what
# its parent sent) or the reply as JSON (the parent never unpickles what a template produced).

class _Worker:
    """The child process that renders, started at the first render and kept; a fresh one after a
    render that ran out of time or memory, or after a fork."""

    _lock = threading.Lock()
    _current: _Worker | None = None
    _exit_registered = False

    def __init__(self):
        load = ("import importlib.util as u; s = u.spec_from_file_location('jaxllm_chat_template', "
                f"{__file__!r}); m = u.module_from_spec(s); s.loader.exec_module(m); m._serve()")
        safe_path = ["-P"] if sys.version_info >= (3, 11) else []  # no working directory on sys.path
        try:
            self.process = subprocess.Popen([sys.executable, *safe_path, "-c", load],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        except OSError as e:
            raise ChatTemplateError(f"the chat template's render process could not be started: {e}") from None
        self.owner = os.getpid()
        if not _Worker._exit_registered:
            atexit.register(_Worker._stop)
            _Worker._exit_registered = True

    @classmethod
    def render(cls, request: dict) -> dict:
        payload = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
        with cls._lock:
            for attempt in (1, 2):  # a second time only if an idle child had gone
                worker = cls._current
                if worker is None or worker.owner != os.getpid() or worker.process.poll() is not None:
                    worker = cls._current = _Worker()
                try:
                    worker.process.stdin.write(struct.pack("<Q", len(payload)) + payload)
                    worker.process.stdin.flush()
                except (BrokenPipeError, OSError):
                    cls._stop()
                    if attempt == 2:
                        raise ChatTemplateError("the chat template's render process ended before "
                                                f"it took the request ({len(payload)} bytes)") from None
                    continue
                try:
                    deadline = time.monotonic() + RENDER_SECONDS
                    (size,) = struct.unpack("<Q", worker.read(8, deadline))
                    return json.loads(worker.read(size, deadline))
                except TimeoutError:
                    cls._stop()
                    raise ChatTemplateError(f"the chat template ran for more than {RENDER_SECONDS:g} s, "
                                            "the limit of one render") from None
                except EOFError:
                    code = cls._stop()
                    raise ChatTemplateError(f"the chat template's render process ended (exit code "
                                            f"{code}) before it replied: it may have exceeded "
                                            f"{RENDER_MEMORY >> 20} MB") from None
                except BaseException:  # Ctrl-C or anything else mid-reply: the stream is out of step
                    cls._stop()
                    raise

    def read(self, size: int, deadline: float) -> bytes:
        fd, got = self.process.stdout.fileno(), bytearray()
        while len(got) < size:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, min(size - len(got), 1 << 24))
            if not chunk:
                raise EOFError
            got += chunk
        return bytes(got)

    @classmethod
    def _stop(cls) -> int | None:
        worker, cls._current = cls._current, None
        if worker is None:
            return None
        worker.process.kill()
        for pipe in (worker.process.stdin, worker.process.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        return worker.process.wait()


def _serve() -> None:
    """The child's loop: a request in, a reply out, until the parent closes the pipe."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops this process
    try:
        import resource
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = RENDER_MEMORY if hard == resource.RLIM_INFINITY else min(RENDER_MEMORY, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ImportError, ValueError, OSError):  # not on this platform: the time limit still holds
        pass
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    while len(header := inp.read(8)) == 8:
        request = pickle.loads(inp.read(struct.unpack("<Q", header)[0]))
        try:
            reply = {"text": _render(**request)}
        except ChatTemplateError as e:
            reply = {"error": str(e)}
        except BaseException as e:  # noqa: BLE001 - even a MemoryError outside the render is reported
            reply = {"error": f"the chat template failed: {type(e).__name__}: {e}"}
        del request
        data = json.dumps(reply).encode()  # ASCII: lone surrogates survive the trip
        out.write(struct.pack("<Q", len(data)) + data)
        out.flush()
