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
