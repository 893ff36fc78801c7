"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers loading the same file.

One transformers load and one jaxllm load per session (module-scoped), both float32. The
project allows 1e-3 relative for this model (dequantized weights, 30 layers of float32
rounding); the logits agree within 4.2e-6, so the test holds them to 1e-4, the tiny models' bound.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import jaxllm
from jaxllm.io import paths

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gguf_path():
    return paths.default_model_path()


@pytest.fixture(scope="module")
def reference(gguf_path):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def params(tmp_path_factory, monkeypatch_module):
    # A private conversion cache: the test proves the GGUF path, then the cached path, from scratch.
    monkeypatch_module.setenv("JAXLLM_CACHE", str(tmp_path_factory.mktemp("jaxllm-cache")))
    return jaxllm.load(dtype="float32")


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def tok():
    return jaxllm.load_tokenizer()


PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
]


def chat_ids(tok, prompt: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]))


def test_config_matches_the_file(params):
    cfg = params.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert (cfg.ffn_size, cfg.vocab_size, cfg.tie_word_embeddings) == (1536, 49152, True)
    assert cfg.rope.theta == 100000.0
    assert 2 in cfg.eos_token_ids  # <|im_end|> ends the assistant's turn


def test_logits_match_transformers(params, reference, tok):
    for prompt in PROMPTS[:2] + ["def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # 斐波那契 🐇"]:
        ids = np.asarray([chat_ids(tok, prompt)])
        ours = np.asarray(jaxllm.forward(params, ids))
        with torch.no_grad():
            ref = reference(torch.as_tensor(ids)).logits.numpy()
        rel = np.abs(ours - ref).max() / np.abs(ref).max()
        assert rel < 1e-4, (prompt, rel)
        assert (ours[0, -1].argmax() == ref[0, -1].argmax())


def test_greedy_chat_answers_match_transformers(params, reference, tok):
    """Each answer, stop token included, equals transformers' greedy answer with the same stop ids."""
    stops = list(params.config.eos_token_ids)
    for prompt in PROMPTS:
        ids = chat_ids(tok, prompt)
        out = jaxllm.generate(params, [ids], max_new_tokens=40)
        ours = np.asarray(out.tokens)[0, :int(out.lengths[0])].tolist()
        with torch.no_grad():
            ref = reference.generate(torch.as_tensor([ids]), max_new_tokens=40, do_sample=False,
                                     eos_token_id=stops, pad_token_id=params.config.pad_id)
        assert ours == ref[0, len(ids):].tolist(), (prompt, tok.decode(ours), tok.decode(ref[0, len(ids):]))


def test_answer_is_sensible_and_stops(params, tok):
    ids = chat_ids(tok, PROMPTS[0])
    out = jaxllm.generate(params, [ids], max_new_tokens=48)
    n = int(out.lengths[0])
    answer = np.asarray(out.tokens)[0, :n].tolist()
    assert answer[-1] in params.config.eos_token_ids, "the chat answer should end with its stop token"
    assert "Paris" in tok.decode(answer)
    assert np.all(np.asarray(out.tokens)[0, n:] == params.config.pad_id)


def test_second_load_uses_the_converted_cache(params, monkeypatch):
    import os
    from pathlib import Path
    cache = Path(os.environ["JAXLLM_CACHE"])
    assert any(cache.glob("*/model.safetensors")), "the first load should cache its conversion"
    from jaxllm.io import gguf

    def no_second_read(path):
        raise AssertionError(f"the GGUF file was read again: {path}")

    monkeypatch.setattr(gguf, "read_gguf", no_second_read)
    monkeypatch.setattr(gguf, "gguf_source", no_second_read)
    again = jaxllm.load(dtype="float32")
    for a, b in zip(jax_leaves(params), jax_leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert again.config == params.config


def jax_leaves(tree):
    import jax
    return jax.tree.leaves(tree)
