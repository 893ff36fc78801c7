"""The chat template's render process: whatever happens around a render (an interrupt, a stopped
or orphaned child, a fork, many open files, a noisy interpreter), the next render gets its own
answer and no process is left behind."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import jaxllm.text.chat_template as chat_template
from jaxllm.text.chat_template import ChatTemplateError, _Worker, render_chat_template
from hangs import error_within

CHAT = [{"role": "user", "content": "x"}]
SLOW = ("{% set r = range(1000) %}{% for a in r %}{% for b in r %}{% for c in r %}"
        "{% endfor %}{% endfor %}{% endfor %}")


def render(n: int) -> str:
    return render_chat_template("{{ messages[0].content }}{{ n }}", CHAT, n=n)


def child_pid() -> int:
    """The pid of the child the next render (from this thread alone) will use."""
    render(0)
    return _Worker._idle[-1].process.pid


def test_an_interrupt_while_the_request_is_sent_leaves_no_stale_reply(monkeypatch):
    """Ctrl-C between two writes of a long request: the next render gets its own text, not the
    reply meant for the interrupted one (which the old child would have sent)."""
    writes, real_write = [], os.write

    def interrupted_write(fd, data):
        writes.append(len(data))
        if len(writes) == 2:
            raise KeyboardInterrupt
        return real_write(fd, data)
    child_pid()
    monkeypatch.setattr(chat_template.os, "write", interrupted_write)
    with pytest.raises(KeyboardInterrupt):
        render_chat_template("{{ messages[0].content | length }}", [{"role": "user", "content": "y" * (8 << 20)}])
    monkeypatch.setattr(chat_template.os, "write", real_write)
    assert [render(n) for n in range(3)] == ["x0", "x1", "x2"]


@pytest.mark.slow
def test_a_stopped_render_process_times_out_while_the_request_is_sent(monkeypatch):
    """The time limit covers sending a conversation too large for the pipe to a child that does
    not read it."""
    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 2.0)
    pid = child_pid()
    os.kill(pid, signal.SIGSTOP)
    big = [{"role": "user", "content": "y" * (8 << 20)}]
    error = error_within(20, lambda: render_chat_template("{{ 1 }}", big), ChatTemplateError)
    assert "ran for more than 2 s" in str(error)
    assert render(5) == "x5" and _Worker._idle[-1].process.pid != pid


def test_a_runaway_in_one_thread_does_not_hold_up_another(monkeypatch):
    """Renders from several threads run in children of their own: quick ones return while a
    runaway in another thread is still under way (they used to take turns in one child, so a quick
    render waited out the runaway's limit)."""
    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 20.0)
    errors = []

    def runaway():
        try:
            render_chat_template(SLOW, CHAT)
        except ChatTemplateError as e:
            errors.append(str(e))
    thread = threading.Thread(target=runaway, daemon=True)
    thread.start()
    time.sleep(0.5)  # its render under way
    try:
        assert [render(n) for n in range(3)] == ["x0", "x1", "x2"]
        assert thread.is_alive()
    finally:
        _Worker.stop_all()
        thread.join(10)
    assert errors and "render process ended" in errors[0]


@pytest.mark.slow
def test_an_interrupt_while_a_render_process_starts_leaves_no_pipe_open(monkeypatch):
    """Ctrl-C inside the start of a render process (here: Popen itself) closes the reply pipe it
    had made; it was left open, one descriptor more with each such interrupt."""
    _Worker.stop_all()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    before = len(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(chat_template.subprocess, "Popen", interrupted)
    for _ in range(3):
        with pytest.raises(KeyboardInterrupt):
            render(1)
    assert len(os.listdir("/proc/self/fd")) == before
    monkeypatch.undo()
    assert render(2) == "x2"


@pytest.mark.slow
def test_a_render_process_that_cannot_start_is_named(monkeypatch):
    """No Python to start (sys.executable empty) or an OSError from Popen: a ChatTemplateError
    saying so, and the next render, with both back, works (the pool's first version raised an
    AttributeError here)."""
    _Worker.stop_all()
    monkeypatch.setattr(chat_template.sys, "executable", "")
    with pytest.raises(ChatTemplateError, match="does not know its own executable"):
        render(1)
    monkeypatch.undo()

    def refused(*args, **kwargs):
        raise OSError(24, "Too many open files")
    monkeypatch.setattr(chat_template.subprocess, "Popen", refused)
    with pytest.raises(ChatTemplateError, match="could not be started: .*Too many open files"):
        render(2)
    monkeypatch.undo()
    assert render(3) == "x3"


def test_renders_work_with_over_a_thousand_files_open():
    """select() refused file descriptors past 1023, so a busy server could not render at all."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(soft, 4096), hard), hard))
    _Worker.stop_all()  # the next child's pipes get descriptors above the 1100 opened here
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        assert render(1) == "x1" and min(_Worker._idle[-1].replies, _Worker._idle[-1].requests) > 1023
    finally:
        for fd in fds:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_noisy_interpreter_does_not_break_the_replies(tmp_path, monkeypatch, capfd):
    """A sitecustomize that prints reaches the child's stdout, which is not where replies go."""
    (tmp_path / "sitecustomize.py").write_text("print('hello from sitecustomize')\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    _Worker.stop_all()
    try:
        assert [render(n) for n in range(2)] == ["x0", "x1"]
        assert "hello from sitecustomize" in capfd.readouterr().out  # the child did start with it
    finally:
        _Worker.stop_all()


def run_alone(script: str, out) -> tuple[str, str]:
    """`script` in a fresh interpreter with this module loaded by itself (no JAX, which warns that
    forking a multithreaded process may deadlock), as `ct`; its stdout and stderr. They go through
    files, not pipes, so that the call returns when the script ends, whatever its children do."""
    load = (f"import importlib.util as u; s = u.spec_from_file_location('ct', {chat_template.__file__!r}); "
            "ct = u.module_from_spec(s); s.loader.exec_module(ct)\n")
    with open(out / "stdout", "w+") as stdout, open(out / "stderr", "w+") as stderr:
        subprocess.run([sys.executable, "-c", load + textwrap.dedent(script)], stdout=stdout,
                       stderr=stderr, timeout=60)
    return (out / "stdout").read_text(), (out / "stderr").read_text()


@pytest.mark.slow
def test_a_fork_while_a_render_is_under_way_renders_in_the_forked_process(tmp_path):
    """The forked process gets turns and a child of its own: it neither waits for ever on a copy
    of turns all taken (here the one turn there is) nor talks to its parent's child."""
    stdout, stderr = run_alone(f"""
        import os, threading, time
        ct.RENDER_SECONDS = 3.0
        ct.RENDER_PROCESSES = 1
        ct._Worker._turns = threading.BoundedSemaphore(1)
        chat = [{{"role": "user", "content": "x"}}]
        threading.Thread(target=lambda: ct.render_chat_template({SLOW!r}, chat), daemon=True).start()
        time.sleep(0.5)  # the thread holds the turn, its render under way
        pid = os.fork()
        if pid == 0:
            os._exit(0 if ct.render_chat_template("{{{{ 2 + 2 }}}}", chat) == "4" else 3)
        _, status = os.waitpid(pid, 0)
        print("forked", os.waitstatus_to_exitcode(status))
        print("parent", ct.render_chat_template("{{{{ 1 + 1 }}}}", chat))
    """, tmp_path)
    assert stdout.split() == ["forked", "0", "parent", "2"], stderr


@pytest.mark.slow
def test_a_render_process_ends_when_its_parent_dies(tmp_path):
    """A caller killed mid-render must not leave its child rendering a runaway template for ever."""
    stdout, stderr = run_alone(f"""
        import os, threading, time
        ct.RENDER_SECONDS = 1000.0
        threading.Thread(target=lambda: ct.render_chat_template({SLOW!r}, [{{"role": "user", "content": "x"}}]),
                         daemon=True).start()
        time.sleep(1.0)
        print(next(iter(ct._Worker._all)).process.pid, flush=True)
        os._exit(0)  # no atexit: the child is orphaned mid-render
    """, tmp_path)
    orphan = int(stdout.split()[0])

    def running() -> bool:  # a zombie has ended: whether it is reaped is up to the machine's init
        try:
            with open(f"/proc/{orphan}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except FileNotFoundError:
            return False
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and running():
        time.sleep(0.1)
    alive = running()
    if alive:
        os.kill(orphan, signal.SIGKILL)
    assert not alive, f"the orphaned render process was still running after 10 s; stderr: {stderr}"


def test_a_render_after_running_out_of_memory_gets_a_fresh_process(monkeypatch):
    pid = child_pid()
    with pytest.raises(ChatTemplateError, match="MemoryError: it needed more than the 2048 MB"):
        render_chat_template("{{ 'a'.ljust(10**10) }}", CHAT)
    assert render(7) == "x7" and _Worker._idle[-1].process.pid != pid
