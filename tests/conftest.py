"""Shared fixtures: tiny random transformers models, each built, saved and loaded once per session.

torch and transformers are imported only when a test asks for a model, so tests that need
neither do not pay for them.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from typing import Any

import numpy as np
import pytest

# The suite is compile-bound (tiny models), and XLA's CPU backend compiles faster at level 0
# (docs/decisions/tests.md). Set before any backend starts; the user's flags win.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import jaxllm  # noqa: E402


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



@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: a machine without it still runs the suite
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a worker a core, at most 4 (each holds JAX, torch and its models); none for
    `pytest -m gpu`, whose tests share one GPU."""
    if "gpu" in (config.getoption("markexpr") or "").replace("not gpu", ""):
        return 0
    return max(1, min(4, len(os.sched_getaffinity(0))))


def pytest_collection_modifyitems(config, items):
    """Skip `gpu` tests, with the reason in the summary, where JAX has no GPU."""
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import jax
    if jax.default_backend() != "gpu":
        skip = pytest.mark.skip(reason="needs a CUDA GPU: run `pytest -m gpu` on one")
        for item in gpu_items:
            item.add_marker(skip)
