"""`jaxllm convert`: converted (optionally int8) params as an orbax checkpoint, with the tokenizer
beside them, restored by `jaxllm.load`; and `--tp` on the CLI."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import jaxllm
from jaxllm.cli import convert as command
from jaxllm.model.params import is_quantized


def _du(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.mark.slow
def test_int8_checkpoint_restores_the_same_params_in_far_fewer_bytes(tmp_path):
    q8 = command.convert(None, tmp_path / "q8", dtype="float32", quant="int8")
    f32 = command.convert(None, tmp_path / "f32", dtype="float32")
    restored = jaxllm.load(q8)
    direct = jaxllm.load(dtype="float32", quant="int8")
    assert is_quantized(restored)
    leaves_a, leaves_b = jax.tree.leaves(restored), jax.tree.leaves(direct)
    assert len(leaves_a) == len(leaves_b)
    for a, b in zip(leaves_a, leaves_b):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # int8 values + float32 per-channel scales against float32 weights; orbax compresses both
    # (measured: 121 MB against 333 MB), so the bound is looser than the 4x of the raw bytes.
    assert _du(q8 / "params") < 0.5 * _du(f32 / "params")
    with pytest.raises(ValueError, match="int8 weights"):
        jaxllm.load(q8, mesh=jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",)))


@pytest.mark.slow
def test_converted_directory_carries_the_tokenizer(tmp_path):
    out = command.convert(None, tmp_path / "ckpt", dtype="float32")
    ours, theirs = jaxllm.load_tokenizer(), jaxllm.load_tokenizer(out)
    text = "Hello 世界 🐇 <|im_start|>user\n\n  def f():\treturn 1"
    assert ours.encode(text) == theirs.encode(text)
    assert ours.eos_token_ids == theirs.eos_token_ids
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(messages)


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "jaxllm", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_cli_convert_then_generate_and_tp(tmp_path):
    dst = tmp_path / "q8"
    done = _cli("convert", str(dst), "--quant", "int8")
    assert done.returncode == 0, done.stderr
    answer = _cli("generate", "What is the capital of France?", "--model", str(dst), "--max-new-tokens", "12")
    assert answer.returncode == 0, answer.stderr
    assert "Paris" in answer.stdout
    # The float default model split over 2 (fake CPU) devices answers as it does on one.
    two = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    one_dev = _cli("generate", "What is the capital of France?", "--max-new-tokens", "12", env=two)
    tp2 = _cli("generate", "What is the capital of France?", "--max-new-tokens", "12", "--tp", "2", env=two)
    assert tp2.returncode == 0, tp2.stderr
    assert tp2.stdout == one_dev.stdout and "Paris" in tp2.stdout
    too_many = _cli("generate", "hi", "--tp", "4", env=two)
    assert too_many.returncode == 2 and "needs 4 devices" in too_many.stderr
    assert "Traceback" not in too_many.stderr


def test_convert_refuses_its_destination_before_loading(tmp_path, monkeypatch):
    """A destination that cannot take the checkpoint is named before the model is loaded (minutes
    for a large one), not after."""
    from jaxllm.io import loader
    monkeypatch.setattr(loader, "load", lambda *a, **k: pytest.fail("the model was loaded first"))
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("kept")
    with pytest.raises(ValueError, match=r"full exists and is not empty"):
        command.convert(None, full)
    with pytest.raises(ValueError, match=r"notes.txt exists and is not a directory"):
        command.convert(None, full / "notes.txt")
    with pytest.raises(ValueError, match=r"notes.txt/sub cannot be made"):
        command.convert(None, full / "notes.txt" / "sub")
    assert (full / "notes.txt").read_text() == "kept"


def test_cli_names_a_path_it_cannot_write(tmp_path, monkeypatch, capsys):
    """A PermissionError (an output directory under a read-only tree, say) is one line, exit 2."""
    from jaxllm import cli

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "/sys/out")
    monkeypatch.setattr(command, "convert", denied)
    assert cli.main(["convert", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "jaxllm convert: error: [Errno 13] Permission denied: '/sys/out'" in err and "Traceback" not in err
