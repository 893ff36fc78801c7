"""Shared fixtures: tiny random transformers models, each built, saved and loaded once per session.

torch and transformers are imported only when a test asks for a model, so tests that need
neither do not pay for them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from typing import Any

import numpy as np
import pytest

import jaxllm


@dataclasses.dataclass
class TinyModel:
    name: str
    path: Path  # the save_pretrained directory
    hf: Any  # the transformers reference (a torch module), float32, eval mode
    params: jaxllm.Params  # the same weights loaded by jaxllm in float32

    def hf_logits(self, tokens) -> np.ndarray:
        import torch
        with torch.no_grad():
            return self.hf(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """tiny(name) -> TinyModel; see tiny_models.VARIANTS for the names."""
    built: dict[str, TinyModel] = {}

    def get(name: str) -> TinyModel:
        if name not in built:
            import tiny_models
            path = tmp_path_factory.mktemp(name)
            hf = tiny_models.build(name, path)
            built[name] = TinyModel(name, path, hf, jaxllm.load(path, dtype="float32"))
        return built[name]
    return get


@pytest.fixture(scope="session")
def llama(tiny) -> TinyModel:
    return tiny("llama")



def pytest_configure(config):
    config.addinivalue_line("markers", "slow: starts a server or loads the default model (deselect with -m 'not slow')")
