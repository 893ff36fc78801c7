"""Hugging Face directories as they come: sharded safetensors with an index, and bf16 weights."""

from __future__ import annotations

import copy
import json

import numpy as np
import torch

import jaxllm
import tiny_models


def test_sharded_checkpoint_with_index_loads_like_one_file(tmp_path, tiny):
    m = tiny("llama")
    m.hf.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "the checkpoint should really be sharded"
    sharded = jaxllm.load(tmp_path, dtype="float32")
    tokens = tiny_models.random_tokens((2, 12))
    np.testing.assert_array_equal(np.asarray(jaxllm.forward(sharded, tokens)),
                                  np.asarray(jaxllm.forward(m.params, tokens)))


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
