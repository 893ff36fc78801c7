"""The JAXLLM_* environment variables: a value that is no setting (nan, garbage, an unknown mode, an
on/off switch spelled otherwise) is a ValueError naming the variable and value, never a bare
conversion error nor a silent default; the values that meant something before still do."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxllm.env import env_choice, env_flag, env_number
from jaxllm.io import compile_cache, loader, paths


def _import_jaxllm(env: dict[str, str], code: str = "import jaxllm"):
    """Run `code` in a fresh interpreter with the JAXLLM_* variables of this one dropped and `env`
    set (import-time reads cannot be redone in this process)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("JAXLLM_")}
    return subprocess.run([sys.executable, "-c", code], env={**base, "JAX_PLATFORMS": "cpu", **env},
                          capture_output=True, text=True, timeout=300)


def _fails_naming(r, message: str):
    assert r.returncode != 0 and r.stderr.splitlines(), r.stdout[-2000:]
    last = r.stderr.splitlines()[-1]
    assert last.startswith("ValueError: ") and message in last, r.stderr[-2000:]


# --- numbers: nan, inf and overflowing values were `int()` errors outside env_number

@pytest.mark.slow
@pytest.mark.parametrize("name, value, message", [
    ("JAXLLM_PREFETCH_MAX_MB", "nan", "JAXLLM_PREFETCH_MAX_MB='nan' is not a finite number"),
    ("JAXLLM_PREFETCH_MAX_MB", "inf", "JAXLLM_PREFETCH_MAX_MB='inf' is not a finite number"),
    ("JAXLLM_LOAD_BUFFER_MB", "nan", "JAXLLM_LOAD_BUFFER_MB='nan' is not a finite number"),
    ("JAXLLM_LOAD_BUFFER_MB", "-inf", "JAXLLM_LOAD_BUFFER_MB='-inf' is not a finite number"),
    ("JAXLLM_LOAD_BUFFER_MB", "1e400", "JAXLLM_LOAD_BUFFER_MB='1e400' is not a finite number"),
    # finite, but inf once scaled to bytes
    ("JAXLLM_LOAD_BUFFER_MB", "1e308", "JAXLLM_LOAD_BUFFER_MB='1e308' is out of range"),
])
def test_a_number_variable_that_is_not_finite_is_named_at_import(name, value, message):
    _fails_naming(_import_jaxllm({name: value}), message)


def test_env_number_refuses_what_is_no_number_and_keeps_what_is(monkeypatch):
    for text, kind, message in [("nan", float, "X='nan' is not a finite number"),
                                ("-Infinity", float, "X='-Infinity' is not a finite number"),
                                ("1e19", float, "X='1e19' is out of range"),
                                (str(2**63), int, f"X='{2**63}' is out of range"),
                                ("nan", int, "X='nan' is not an integer"),
                                ("1.5", int, "X='1.5' is not an integer")]:
        monkeypatch.setenv("X", text)
        with pytest.raises(ValueError, match=f"environment variable {message}"):
            env_number("X", "4", kind)
    for text, kind, want in [("0", float, 0.0), ("16", float, 16.0), ("0.5", float, 0.5),
                             ("-3", int, -3), (str(2**63 - 1), int, 2**63 - 1)]:
        monkeypatch.setenv("X", text)
        assert env_number("X", "4", kind) == want
    monkeypatch.delenv("X")
    assert env_number("X", "4", float) == 4.0 and env_number("X", 192) == 192


# --- choices and switches: garbage was taken for the default

@pytest.mark.slow
@pytest.mark.parametrize("name, value, message", [
    ("JAXLLM_DECODE_ATTENTION", "XLA", "JAXLLM_DECODE_ATTENTION='XLA' is not one of 'auto', 'xla', 'interpret'"),
    ("JAXLLM_ROUTE", "interpet", "JAXLLM_ROUTE='interpet' is not one of 'auto', 'xla', 'interpret'"),
    ("JAXLLM_ATTENTION", "garbage", "JAXLLM_ATTENTION='garbage' is not one of 'auto', 'cudnn', 'xla'"),
    ("JAXLLM_GEMV", "garbage", "JAXLLM_GEMV='garbage' is not one of 'reduce', 'dot'"),
    ("JAXLLM_GROUPED_GEMM", "off", "JAXLLM_GROUPED_GEMM='off' is not one of 'auto', 'xla'"),
    ("JAXLLM_WEIGHTS_FIRST", "maybe", "JAXLLM_WEIGHTS_FIRST='maybe' is not an on/off switch"),
    ("JAXLLM_MOE_SWIGLU_REDUCE", "2", "JAXLLM_MOE_SWIGLU_REDUCE='2' is not an on/off switch"),
    ("JAXLLM_NO_COMPILE_CACHE", "maybe", "JAXLLM_NO_COMPILE_CACHE='maybe' is not an on/off switch"),
])
def test_a_switch_set_to_garbage_is_named_at_import(name, value, message):
    _fails_naming(_import_jaxllm({name: value}), message)


_SWITCHES = """
import json
from jaxllm.io import compile_cache
from jaxllm.kernels import TUNING
from jaxllm.layers import dense, moe
names = ["DECODE_ATTENTION", "DECODE_PROJECT", "ROWS_PROJECT", "ADD_NORM", "ROUTE", "INT8_CONVERT",
         "PDL_TRIGGER", "INT8_DIGITS", "INT8_HEAD_DIGITS", "INT8_DOWN_DIGITS", "GATE_UP_WIDE",
         "INT8_NORM_APART", "PREFETCH_LINES", "WEIGHTS_FIRST", "SQUARES_LAST", "ADD_NORM_TRIGGER"]
seen = {n: getattr(TUNING, n.lower()) for n in names}
seen.update({n: getattr(dense, n) for n in ["GEMV", "ATTENTION"]})
seen.update({n: getattr(moe, n) for n in ["GROUPED_GEMM", "MOE_SWIGLU_REDUCE"]})
seen["NO_COMPILE_CACHE"] = compile_cache._env_off()
print(json.dumps(seen))
"""

_DEFAULTS = dict(DECODE_ATTENTION="auto", DECODE_PROJECT="auto", ROWS_PROJECT="auto", ADD_NORM="auto",
                 ROUTE="auto", INT8_CONVERT="permute", PDL_TRIGGER=True, INT8_DIGITS=True,
                 INT8_HEAD_DIGITS=True, INT8_DOWN_DIGITS=True, GATE_UP_WIDE=True, INT8_NORM_APART=True,
                 PREFETCH_LINES=True, WEIGHTS_FIRST=True, SQUARES_LAST=True, ADD_NORM_TRIGGER=True,
                 GEMV="reduce", ATTENTION="auto", GROUPED_GEMM="auto", MOE_SWIGLU_REDUCE=True,
                 NO_COMPILE_CACHE=False)


def _switches(env: dict[str, str]) -> dict:
    r = _import_jaxllm(env, _SWITCHES)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.splitlines()[-1])


@pytest.mark.slow
def test_unset_or_empty_switches_keep_their_defaults():
    assert _switches({}) == _DEFAULTS
    empty = {"JAXLLM_" + n: "" for n in _DEFAULTS if n != "ADD_NORM_TRIGGER"} | {"JAXLLM_PDL_ADD_NORM": ""}
    assert _switches(empty) == _DEFAULTS


@pytest.mark.slow
def test_switches_take_every_spelling_of_on_and_off_and_every_mode():
    env = dict(JAXLLM_DECODE_ATTENTION="xla", JAXLLM_DECODE_PROJECT="interpret", JAXLLM_ROWS_PROJECT="xla",
               JAXLLM_ADD_NORM="auto", JAXLLM_ROUTE="interpret", JAXLLM_INT8_CONVERT="i2f",
               JAXLLM_PDL_TRIGGER="0", JAXLLM_INT8_DIGITS="false", JAXLLM_INT8_HEAD_DIGITS="OFF",
               JAXLLM_INT8_DOWN_DIGITS="no", JAXLLM_GATE_UP_WIDE="False", JAXLLM_INT8_NORM_APART=" 0 ",
               JAXLLM_PREFETCH_LINES="1", JAXLLM_WEIGHTS_FIRST="false", JAXLLM_SQUARES_LAST="off",
               JAXLLM_PDL_ADD_NORM="yes", JAXLLM_GEMV="dot", JAXLLM_ATTENTION="cudnn",
               JAXLLM_GROUPED_GEMM="xla", JAXLLM_MOE_SWIGLU_REDUCE="On", JAXLLM_NO_COMPILE_CACHE="true")
    assert _switches(env) == dict(
        DECODE_ATTENTION="xla", DECODE_PROJECT="interpret", ROWS_PROJECT="xla", ADD_NORM="auto",
        ROUTE="interpret", INT8_CONVERT="i2f", PDL_TRIGGER=False, INT8_DIGITS=False,
        INT8_HEAD_DIGITS=False, INT8_DOWN_DIGITS=False, GATE_UP_WIDE=False, INT8_NORM_APART=False,
        PREFETCH_LINES=True, WEIGHTS_FIRST=False, SQUARES_LAST=False, ADD_NORM_TRIGGER=True,
        GEMV="dot", ATTENTION="cudnn", GROUPED_GEMM="xla", MOE_SWIGLU_REDUCE=True, NO_COMPILE_CACHE=True)


def test_env_choice_and_env_flag(monkeypatch):
    monkeypatch.delenv("X", raising=False)
    assert env_choice("X", ("auto", "xla"), "auto") == "auto" and env_flag("X", True) is True
    monkeypatch.setenv("X", "")
    assert env_choice("X", ("auto", "xla"), "auto") == "auto" and env_flag("X", False) is False
    monkeypatch.setenv("X", "xla")
    assert env_choice("X", ("auto", "xla"), "auto") == "xla"
    for text in ("Xla", "xla ", "none"):
        monkeypatch.setenv("X", text)
        with pytest.raises(ValueError, match=f"environment variable X='{text}' is not one of 'auto', 'xla'"):
            env_choice("X", ("auto", "xla"), "auto")
    for text, want in [("1", True), ("TRUE", True), ("yes", True), ("on", True),
                       ("0", False), ("false", False), ("No", False), ("off", False)]:
        monkeypatch.setenv("X", text)
        assert env_flag("X", not want) is want, text
    for text in ("2", "enabled", "y"):
        monkeypatch.setenv("X", text)
        with pytest.raises(ValueError, match=rf"environment variable X='{text}' is not an on/off switch "
                                             r"\(1/0, true/false, yes/no, on/off\)"):
            env_flag("X", True)


def test_no_compile_cache_is_an_on_off_switch(monkeypatch):
    for text, off in [("1", True), ("yes", True), ("0", False), ("false", False), ("", False)]:
        monkeypatch.setenv("JAXLLM_NO_COMPILE_CACHE", text)
        assert compile_cache._env_off() is off, text
    monkeypatch.setenv("JAXLLM_NO_COMPILE_CACHE", "maybe")
    # raised before enable() changes anything, not logged away as "compilation cache off"
    before = (compile_cache.directory(), compile_cache._ours)
    with pytest.raises(ValueError, match="JAXLLM_NO_COMPILE_CACHE='maybe' is not an on/off switch"):
        compile_cache.enable()
    assert (compile_cache.directory(), compile_cache._ours) == before


# --- JAXLLM_CACHE='~/jx': both caches under the home directory, not under ./~

def test_a_cache_directory_with_a_tilde_is_expanded(monkeypatch, tmp_path):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    monkeypatch.setenv("JAXLLM_CACHE", "~/jx")
    assert paths.cache_dir() == home / "jx"
    assert compile_cache.default_dir() == home / "jx" / "xla"
    gguf = work / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert loader._gguf_cache_path(gguf, "float32").parent == home / "jx"
    monkeypatch.delenv("JAXLLM_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", "~/xdg")
    assert paths.cache_dir() == home / "xdg" / "jaxllm"


def test_the_loop_graph_is_an_on_off_switch(monkeypatch):
    """JAXLLM_LOOP_GRAPH, read at each generate: "off" turns the graph off (only "0" did), and
    garbage is named (it left the graph on)."""
    import importlib
    gen = importlib.import_module("jaxllm.engine.generate")
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    for value, graph in (("off", False), ("0", False), ("yes", True), ("", True)):
        monkeypatch.setenv("JAXLLM_LOOP_GRAPH", value)
        assert gen._choice()[0] is graph, value
    monkeypatch.setenv("JAXLLM_LOOP_GRAPH", "sometimes")
    with pytest.raises(ValueError, match=r"JAXLLM_LOOP_GRAPH='sometimes' is not an on/off switch"):
        gen._choice()
