"""Hugging Face directories as they come: sharded safetensors with an index, and bf16 weights."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest
import torch
import transformers

import jaxllm
from jaxllm.families import config_from_hf, config_to_hf
import tiny_models
from jaxllm.io import hf, loader
from jaxllm.io.reading import from_hf_tensors
from jaxllm.tools import presets


@pytest.mark.slow
def test_sharded_checkpoint_with_index_loads_like_one_file(tmp_path, tiny):
    m = tiny("llama")
    m.hf.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "the checkpoint should really be sharded"
    sharded = jaxllm.load(tmp_path, dtype="float32")
    tokens = tiny_models.random_tokens((2, 12))
    np.testing.assert_array_equal(np.asarray(jaxllm.forward(sharded, tokens)),
                                  np.asarray(jaxllm.forward(m.params, tokens)))


@pytest.mark.slow
def test_bf16_checkpoint_matches_transformers_in_bf16(tmp_path, tiny):
    m = tiny("qwen3")
    hf_bf16 = copy.deepcopy(m.hf).to(torch.bfloat16)  # the shared float32 reference stays as it is
    hf_bf16.save_pretrained(tmp_path)
    params = jaxllm.load(tmp_path, dtype="bfloat16")
    assert params.dtype == np.dtype("bfloat16")
    tokens = tiny_models.random_tokens((1, 12))
    with torch.no_grad():
        ref = hf_bf16(torch.as_tensor(tokens)).logits.float().numpy()
    ours = np.asarray(jaxllm.forward(params, tokens))
    # bf16 results depend on kernel order: a relative bound, not equality (see DESIGN.md).
    assert tiny_models.rel_err(ours, ref) < 3e-2
    # The same bf16 weights upcast: loading converts without losing a bit.
    exact = jaxllm.load(tmp_path, dtype="float32")
    np.testing.assert_array_equal(np.asarray(exact.embed),
                                  hf_bf16.model.embed_tokens.weight.detach().float().numpy())


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_presets_write_a_config_json_that_reads_back_as_the_preset(name):
    cfg = presets.PRESETS[name]
    assert config_from_hf(json.loads(json.dumps(config_to_hf(cfg)))) == cfg


# Every family and switch of the tiny models, whose config.json transformers must read as jaxllm
# does (rope variants, biases, sliding windows on every layer or some, q/k norms), and experts.
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(tiny_models.VARIANTS) + ["tiny-moe"])
def test_written_checkpoints_load_in_transformers_as_in_jaxllm(tmp_path, name):
    cfg = presets.PRESETS.get(name) or config_from_hf(tiny_models.hf_config(name).to_dict())
    files = presets.write_checkpoint(cfg, tmp_path, seed=3, dtype="float32", scale=0.2,
                                     shard_bytes=200_000)
    assert len(files) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    params = jaxllm.load(tmp_path, dtype="float32")
    assert params.config == cfg  # what was written reads back whole
    tokens = tiny_models.random_tokens((2, 12))
    with torch.no_grad():
        ref = reference(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
    assert tiny_models.rel_err(jaxllm.forward(params, tokens), ref) < 1e-4


@pytest.mark.slow
def test_the_backend_starts_before_the_checkpoint_is_read(tmp_path):
    """In a fresh process, as a user's: load brings the device backend up before its readers
    start, even with dtype given, so the backend's own reads (its libraries, on a fresh machine)
    do not queue behind the checkpoint's."""
    presets.write_checkpoint(presets.PRESETS["tiny"], tmp_path, dtype="float32")
    code = (
        "import sys, jaxllm\n"
        "from jax._src import xla_bridge\n"
        "from jaxllm.io import loader\n"
        "seen, read = [], loader.from_hf_tensors\n"
        "def spy(*args, **kwargs):\n"
        "    seen.append(xla_bridge.backends_are_initialized())\n"
        "    return read(*args, **kwargs)\n"
        "loader.from_hf_tensors = spy\n"
        "assert not xla_bridge.backends_are_initialized()\n"
        "jaxllm.load(sys.argv[1], dtype='float32')\n"
        "print(seen)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["[True]"]


def test_loading_threads_give_the_same_params(tmp_path, monkeypatch, llama):
    llama.hf.save_pretrained(tmp_path, max_shard_size="40KB")
    monkeypatch.setattr(loader, "LOAD_THREADS", 1)
    one = jaxllm.load(tmp_path, dtype="float32")
    monkeypatch.setattr(loader, "LOAD_THREADS", 8)
    eight = jaxllm.load(tmp_path, dtype="float32")
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(eight), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


class _Failing(hf.ArraySource):
    """The checkpoint's tensors, one of which cannot be read."""

    def __init__(self, reader, bad: str):
        super().__init__({name: reader.get(name) for name in reader.shapes})
        self.bad = bad

    def read_into(self, name, view):
        if name == self.bad:
            raise ValueError(f"{name} could not be read")
        super().read_into(name, view)


def test_a_failed_read_on_a_loading_thread_is_raised_and_the_threads_end(llama):
    cfg, reader = hf.read_checkpoint(llama.path)
    with reader:
        failing = _Failing(reader, "model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ValueError, match="up_proj.weight could not be read"):
        from_hf_tensors(cfg, failing, threads=4)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("jaxllm-")]

    def place(path, x):  # a device that refuses one parameter
        if path == "layers.0.wo":
            raise RuntimeError("RESOURCE_EXHAUSTED placing layers.0.wo")
        return jax.numpy.asarray(x)
    failing.bad = None
    with pytest.raises(RuntimeError, match="placing layers.0.wo"):
        from_hf_tensors(cfg, failing, place=place, threads=4)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("jaxllm-")]


def test_host_memory_read_ahead_of_the_device_stays_within_the_buffer(llama):
    """Readers wait while `buffer_bytes` are read and not yet placed; one parameter larger than
    the buffer still goes when nothing else is held."""
    cfg, reader = hf.read_checkpoint(llama.path)
    lock, held, most, largest = threading.Lock(), [0], [0], [0]

    class Counting(hf.ArraySource):
        def read_into(self, name, view):
            super().read_into(name, view)
            with lock:
                held[0] += view.nbytes
                most[0] = max(most[0], held[0])

    def place(path, x):
        with lock:
            held[0] -= x.nbytes
            largest[0] = max(largest[0], x.nbytes)
        return jax.numpy.asarray(x)
    with reader:
        source = Counting({name: reader.get(name) for name in reader.shapes})
    buffer = 3000  # bytes: under the largest parameter of the tiny llama
    params = from_hf_tensors(cfg, source, place=place, threads=8, buffer_bytes=buffer)
    assert held[0] == 0 and largest[0] > buffer
    assert most[0] <= max(buffer, largest[0])
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(llama.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_reading_into_a_slice_reads_the_tensor_in_c_order(tmp_path):
    from safetensors.numpy import save_file
    t = np.arange(2 * 3 * 4, dtype=np.float32).reshape(6, 4)
    save_file({"t": t}, str(tmp_path / "model.safetensors"))
    with hf.SafetensorsReader([tmp_path / "model.safetensors"]) as reader:
        out = np.zeros((2, 5, 4), np.float32)
        reader.read_into("t", out[:, 1:4])  # three rows of each of two blocks: two runs
        np.testing.assert_array_equal(out[:, 1:4], t.reshape(2, 3, 4))
        assert not out[:, 0].any() and not out[:, 4].any()
        with pytest.raises(ValueError, match="holds 96 bytes"):
            reader.read_into("t", out[:, :2])
