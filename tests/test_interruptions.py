"""What the command line leaves behind and tells the user (issue 61): interrupted conversions and
cache writes leave nothing partial, a damaged conversion is never cached, long prompts prefill in
chunks, cut answers say so, and the small mistakes get one clear line.

Signals go to real child processes; each waits only for the moment it needs, bounded.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxllm
from jaxllm import cli
from test_cli import tiny_model  # noqa: F401  (the fixture: a tiny chat model with its tokenizer)

ROOT = Path(__file__).resolve().parent.parent


def _env(**extra) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith("JAXLLM_")}
    return {**base, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), **extra}


# --- 7: the smaller items --------------------------------------------------------------------------


def test_a_fractional_count_names_the_flag_not_a_function(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "hi", "--max-new-tokens", "1.5"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --max-new-tokens: must be a whole number >= 1, got '1.5'" in err
    assert "positive_int" not in err


@pytest.mark.slow
def test_a_bad_jaxllm_variable_ends_the_cli_with_one_line_and_exit_2():
    r = subprocess.run([sys.executable, "-m", "jaxllm", "generate", "hi"], env=_env(JAXLLM_LOAD_THREADS="x"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [
        "jaxllm: error: environment variable JAXLLM_LOAD_THREADS='x' is not an integer"]


@pytest.mark.slow
def test_switching_from_greedy_to_sampling_gives_no_bucket_advice():
    from jaxllm.engine.compile import RecompileWarning
    from jaxllm.model.config import ModelConfig

    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=16, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=8, ffn_size=32, max_position_embeddings=128)
    params = jaxllm.init_params(cfg, jax.random.key(3), jnp.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jaxllm.generate(params, [[1] * 5], max_new_tokens=4)
        jaxllm.generate(params, [[1] * 5], max_new_tokens=4, temperature=0.7)
        jaxllm.generate(params, [[1] * 5], max_new_tokens=4, temperature=0.7, top_k=3)
        assert not [w for w in caught if w.category is RecompileWarning]
        jaxllm.generate(params, [[1] * 20], max_new_tokens=4, temperature=0.7)  # a new prompt bucket
        recompiles = [w for w in caught if w.category is RecompileWarning]
        assert len(recompiles) == 1 and "prompt bucket 32" in str(recompiles[0].message)


def test_an_integer_projection_is_refused_by_name(llama, tmp_path):
    from safetensors.numpy import load_file, save_file

    for f in llama.path.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(llama.path / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = tensors[name].astype(np.int32)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=f"tensor {name} is stored as int32; its weights must be a floating"):
        jaxllm.load(tmp_path, dtype="float32")


def test_an_empty_model_directory_lacks_config_and_weights(tmp_path, capsys):
    assert cli.main(["generate", "hi", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "holds no model: it has no config.json" in err and "tokenizer" not in err


# --- 1: `jaxllm convert` interrupted, or failing, leaves nothing behind ------------------------------

# The child runs the CLI with one function wrapped to say "AT <moment>" and wait there to be
# signalled: `load` (the model loading), `save` (orbax's save started, its writes under way),
# `tokenizer` (the weights written, the tokenizer not yet).
CHILD = """
import sys, time
moment = sys.argv[1]
def pause(fn):
    def wrapped(*a, **k):
        out = fn(*a, **k) if moment == "save" else None
        print("AT", moment, flush=True)
        for _ in range(600):  # short sleeps: a signal that lands on another thread is seen within 0.1 s
            time.sleep(0.1)
        return out if moment == "save" else fn(*a, **k)
    return wrapped
from jaxllm.cli import convert as c
import orbax.checkpoint as ocp
if moment == "load":
    c.load = pause(c.load)
elif moment == "save":
    ocp.StandardCheckpointer.save = pause(ocp.StandardCheckpointer.save)
elif moment == "tokenizer":
    c.load_tokenizer = pause(c.load_tokenizer)
from jaxllm import cli
sys.exit(cli.main(sys.argv[2:]))
"""


def _signalled_convert(moment: str, sig, src: Path, dst: Path):
    """Run `jaxllm convert src dst` in a child, send `sig` when it reaches `moment`; its result."""
    p = subprocess.Popen([sys.executable, "-c", CHILD, moment, "convert", str(src), str(dst)], env=_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line.strip() == f"AT {moment}", (line, p.stderr.read()[-3000:] if p.poll() is not None else "")
        p.send_signal(sig)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return p.returncode, err


@pytest.mark.slow
@pytest.mark.parametrize("moment, sig, code, said", [
    ("load", "SIGINT", 130, "jaxllm convert: interrupted"),
    ("save", "SIGTERM", 143, "jaxllm convert: terminated"),
    ("save", "SIGINT", 130, "jaxllm convert: interrupted"),
    ("tokenizer", "SIGINT", 130, "jaxllm convert: interrupted"),
    ("save", "SIGKILL", -9, None),
])
def test_a_signalled_convert_leaves_nothing_and_a_rerun_succeeds(tiny_model, tmp_path, moment, sig, code, said):
    import signal

    from jaxllm.cli import convert as command

    dst = tmp_path / "made" / "deeper" / "out"  # parents this run makes
    rc, err = _signalled_convert(moment, getattr(signal, sig), tiny_model, dst)
    assert rc == code, err[-3000:]
    if said is not None:
        assert err.strip().splitlines() == [said], err[-3000:]
        assert list(tmp_path.iterdir()) == []  # no DST, no temporary, no parent it made
    else:  # SIGKILL: nothing can clean up; the next run sweeps the dead one's temporary
        assert not dst.exists()
    out = command.convert(tiny_model, dst)
    assert sorted(p.name for p in dst.parent.iterdir()) == ["out"]
    assert (out / "tokenizer.json").is_file() and (out / "jaxllm_config.json").is_file()
    jaxllm.load(out)


def test_a_failed_convert_leaves_no_destination(tmp_path):
    from jaxllm.cli import convert as command

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{not json")
    for dst in (tmp_path / "new" / "out", tmp_path / "out"):
        with pytest.raises(ValueError):
            command.convert(src, dst)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    empty = tmp_path / "empty"
    empty.mkdir()  # the user's own empty directory stays
    with pytest.raises(ValueError):
        command.convert(src, empty)
    assert empty.is_dir() and list(empty.iterdir()) == []


@pytest.mark.slow
def test_ctrl_c_in_the_middle_of_orbax_writes_is_one_line(tmp_path):
    """The default model's 538 MB float32 checkpoint, interrupted while orbax's threads write it:
    one line, exit 130 and nothing left, however many writes were still under way."""
    import signal

    dst = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-c", CHILD, "save", "convert", str(dst), "--dtype", "float32"],
                         env=_env(JAXLLM_CACHE=os.environ.get("JAXLLM_CACHE", str(jaxllm.io.paths.cache_dir()))),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line.strip() == "AT save", (line, p.stderr.read()[-3000:] if p.poll() is not None else "")
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130 and err.strip().splitlines() == ["jaxllm convert: interrupted"], err[-3000:]
    assert list(tmp_path.iterdir()) == []


# --- 2, 3, 4: the GGUF converted-weights cache -----------------------------------------------------

GGUF_CHILD = """
import sys, time
moment = sys.argv[1]
from jaxllm.io import loader
def pause(fn, after):
    def wrapped(*a, **k):
        out = fn(*a, **k) if after else None
        print("AT", moment, flush=True)
        for _ in range(600):  # short sleeps: a signal that lands on another thread is seen within 0.1 s
            time.sleep(0.1)
        return out if after else fn(*a, **k)
    return wrapped
if moment == "writing":  # the temporary entry made, the tensors about to be converted into it
    loader._convert = pause(loader._convert, after=False)
elif moment == "commit":  # every tensor written and checked, the entry not yet moved into place
    loader._CacheWriter.commit = pause(loader._CacheWriter.commit, after=False)
from jaxllm import cli
sys.exit(cli.main(sys.argv[2:]))
"""


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch):
    """(a tiny Q8_0 GGUF file, the cache directory it converts into, set as JAXLLM_CACHE here)."""
    import gguf
    from test_gguf import write_tiny

    path = tmp_path / "tiny.gguf"
    write_tiny(path, "llama", quant=gguf.GGMLQuantizationType.Q8_0)
    cache = tmp_path / "cache"
    monkeypatch.setenv("JAXLLM_CACHE", str(cache))
    return path, cache


def _entries(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if p.name != "xla") if cache.exists() else []


@pytest.mark.slow
@pytest.mark.parametrize("moment, sig, code", [("writing", "SIGTERM", 143), ("commit", "SIGTERM", 143),
                                               ("writing", "SIGINT", 130), ("writing", "SIGKILL", -9)])
def test_a_signalled_first_start_leaves_no_partial_cache_entry(tiny_gguf, moment, sig, code):
    import signal

    path, cache = tiny_gguf
    argv = ["generate", "hi", "--model", str(path), "--dtype", "float32", "--max-new-tokens", "1"]
    p = subprocess.Popen([sys.executable, "-c", GGUF_CHILD, moment, *argv], env=_env(JAXLLM_CACHE=str(cache)),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line.strip() == f"AT {moment}", p.stderr.read()[-3000:] if p.poll() is not None else line
        assert any(".tmp" in name for name in _entries(cache))  # the partial entry exists now
        p.send_signal(getattr(signal, sig))
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == code, err[-3000:]
    if sig != "SIGKILL":
        assert err.strip().splitlines()[-1] == f"jaxllm generate: {'terminated' if code == 143 else 'interrupted'}"
        assert _entries(cache) == []
    jaxllm.load(path, dtype="float32")  # the next start: sweeps a killed one's temporary, caches
    (entry,) = _entries(cache)
    assert ".tmp" not in entry and (cache / entry / "model.safetensors").is_file()


def test_a_damaged_gguf_is_named_and_never_cached(tiny_gguf):
    import gguf

    path, cache = tiny_gguf
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.ffn_down.weight")
    with open(path, "r+b") as f:
        f.seek(tensor.data_offset)
        f.write(b"\xff" * 64)  # a block's scale becomes nan
    for _ in range(2):
        with pytest.raises(ValueError, match=f"{path}: tensor 'blk.0.ffn_down.weight' .* holds nan"):
            jaxllm.load(path, dtype="float32")
        assert _entries(cache) == []


def test_a_damaged_cached_copy_is_named_removed_and_converted_again(tiny_gguf):
    import json
    import struct

    path, cache = tiny_gguf
    jaxllm.load(path, dtype="float32")
    (entry,) = _entries(cache)
    weights = cache / entry / "model.safetensors"
    raw = weights.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    at = 8 + n + json.loads(raw[8:8 + n])["model.layers.0.mlp.down_proj.weight"]["data_offsets"][0]
    with open(weights, "r+b") as f:
        f.seek(at)
        f.write(b"\xff" * 16)
    with pytest.raises(ValueError) as e:
        jaxllm.load(path, dtype="float32")
    assert str(cache / entry) in str(e.value) and str(path) in str(e.value) and "holds nan" in str(e.value)
    assert _entries(cache) == []
    jaxllm.load(path, dtype="float32")  # converted again, from the file
    assert _entries(cache) == [entry]


def test_the_second_of_two_starts_says_nothing_when_the_first_cached_it(tiny_gguf, monkeypatch, capsys):
    import shutil

    from jaxllm.io import loader

    path, cache = tiny_gguf
    jaxllm.load(path, dtype="float32")
    (entry,) = _entries(cache)
    won = cache.parent / "won"
    shutil.move(cache / entry, won)
    commit = loader._CacheWriter.commit

    def other_process_first(self, *args):  # the other process moves its entry in just before
        shutil.copytree(won, self.target)
        return commit(self, *args)
    monkeypatch.setattr(loader._CacheWriter, "commit", other_process_first)
    capsys.readouterr()
    jaxllm.load(path, dtype="float32")
    assert capsys.readouterr().err == ""
    assert _entries(cache) == [entry]


# --- 6: runaway answers ----------------------------------------------------------------------------


def _fake_stream(tok, answers: list, prompts: list):
    """A `jaxllm.stream` that plays `answers` in turn: token ids, then a stop (an int) or an
    exception to raise (Ctrl-C while the answer streams)."""
    turns = iter(answers)

    def stream(params, ids, *, eos_token_ids, max_new_tokens, **kwargs):
        prompts.append(tok.decode(ids))
        text, end = next(turns)
        yield from tok.encode(text)[:max_new_tokens]
        if isinstance(end, BaseException):
            raise end
        if end == "stop":
            yield eos_token_ids[0]
    return stream


def test_an_answer_cut_at_max_new_tokens_says_so(tiny_model, monkeypatch, capsys):
    tok = jaxllm.load_tokenizer(tiny_model)
    long = " Paris ok" * 20
    n = len(tok.encode(long)) - 3
    monkeypatch.setattr(jaxllm, "stream", _fake_stream(tok, [(long, None), (" ok", "stop")], []))
    assert cli.main(["generate", "hi", "--model", str(tiny_model), "--max-new-tokens", str(n)]) == 0
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"jaxllm: stopped at --max-new-tokens {n}"
    assert cli.main(["generate", "hi", "--model", str(tiny_model), "--max-new-tokens", str(n)]) == 0
    assert "stopped at" not in capsys.readouterr().err  # the answer ended by itself


def test_ctrl_c_stops_the_answer_and_the_chat_goes_on(tiny_model, monkeypatch, capsys):
    import io

    tok = jaxllm.load_tokenizer(tiny_model)
    prompts: list = []
    monkeypatch.setattr(jaxllm, "stream", _fake_stream(
        tok, [(" Paris ok", KeyboardInterrupt()), (" ok", "stop")], prompts))
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n/help\nand France?\n"))
    assert cli.main(["chat", "--model", str(tiny_model)]) == 0
    captured = capsys.readouterr()
    assert captured.out == " Paris ok\n ok\n"
    assert "answer stopped" in captured.err and "/reset clears the history" in captured.err
    assert len(prompts) == 2 and "/help" not in prompts[1]  # /help never reached the model
    assert prompts[1].startswith(prompts[0] + " Paris ok")  # what was shown stays in the history


def test_ctrl_c_at_the_chat_prompt_ends_the_chat(tiny_model, monkeypatch, capsys):
    def interrupted(prompt=""):
        raise KeyboardInterrupt
    monkeypatch.setattr("builtins.input", interrupted)
    assert cli.main(["chat", "--model", str(tiny_model)]) == 0


# --- 5: long prompts prefill in chunks -------------------------------------------------------------


@pytest.mark.slow
def test_a_prompt_longer_than_the_chunk_gives_the_one_shot_answer(monkeypatch, capsys):
    from jaxllm.engine import generate as engine
    from jaxllm.model.config import ModelConfig

    cfg = ModelConfig(model_type="llama", vocab_size=97, hidden_size=32, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, ffn_size=48, max_position_embeddings=256)
    params = jaxllm.init_params(cfg, jax.random.key(5), jnp.float32)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 97, 40)), list(rng.integers(3, 97, 23))]  # bucket 64, ragged
    one_shot = jaxllm.generate(params, prompts, max_new_tokens=12)
    streamed = list(jaxllm.stream(params, prompts[0], max_new_tokens=12))
    monkeypatch.setattr(engine, "PREFILL_CHUNK", 16)  # 64 = 4 chunks
    assert engine.prefill_chunk(64, params) == 16
    chunked = jaxllm.generate(params, prompts, max_new_tokens=12)
    np.testing.assert_array_equal(np.asarray(chunked.tokens), np.asarray(one_shot.tokens))
    np.testing.assert_array_equal(np.asarray(chunked.lengths), np.asarray(one_shot.lengths))
    assert list(jaxllm.stream(params, prompts[0], max_new_tokens=12)) == streamed

    # On a terminal, a prefill that runs past PROGRESS_AFTER_S shows its progress, then erases it.
    monkeypatch.setattr(engine, "PROGRESS_AFTER_S", 0.0)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    capsys.readouterr()
    assert list(jaxllm.stream(params, prompts[0], max_new_tokens=12)) == streamed
    err = capsys.readouterr().err
    assert "\rjaxllm: prefill 16/64 tokens" in err and err.endswith("\r\033[K")
    chunked = jaxllm.generate(params, prompts, max_new_tokens=12)
    np.testing.assert_array_equal(np.asarray(chunked.tokens), np.asarray(one_shot.tokens))
    err = capsys.readouterr().err
    assert "jaxllm: prefill 48/64 tokens" in err and err.endswith("\r\033[K")


@pytest.mark.slow
def test_a_long_prompt_prefill_holds_chunk_sized_scores_not_the_whole_prompts():
    """The compiled generate of a 4096-token prompt: its [T, T] scores alone are 256 MB, a 1024-token
    chunk's [1024, S] a quarter of that."""
    from jaxllm.engine import generate as engine
    from jaxllm.engine import memory
    from jaxllm.engine.sampling import SamplingConfig
    from jaxllm.model.config import ModelConfig

    cfg = ModelConfig(model_type="llama", vocab_size=97, hidden_size=32, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=8, ffn_size=48, max_position_embeddings=8192)
    params = jaxllm.init_params(cfg, jax.random.key(6), jnp.float32)
    T, steps = 4096, 16
    sampling = SamplingConfig(0.0, 0, 1.0, 0.0, 1.0, 0.0, 0.0, 0).validate()
    args = (params, jax.ShapeDtypeStruct((1, T), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32),
            jnp.int32(steps), engine._stop_array([1]), sampling.values(1))

    def allocated(chunk):
        compiled = engine._generate_core_host_loop.trace(
            *args, cache_length=T + steps, steps=steps, flags=sampling.static(), chunk=chunk).lower().compile()
        return memory.program_bytes(compiled)
    assert engine.prefill_chunk(T, params) == 1024
    chunked, whole = allocated(1024), allocated(None)
    assert chunked < whole / 3, (chunked, whole)
