"""Hugging Face checkpoint directories: config.json, generation_config.json and safetensors.

Only safetensors are read (no pickle): `.bin`/`.pt` checkpoints are refused with a message.
Tensors are read through the `safetensors` library, shapes are checked against the config before
any data is converted, and each parameter is converted once into jaxllm's layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from typing import Callable

import jax
import numpy as np
from safetensors import SafetensorError, safe_open

from jaxllm.config import ModelConfig

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def read_config(path: Path) -> ModelConfig:
    """ModelConfig from config.json, with stop ids from generation_config.json when present."""
    cfg = ModelConfig.from_hf(path / "config.json")
    gen = path / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except json.JSONDecodeError as e:
            raise ValueError(f"{gen} is not valid JSON: {e}") from None
        if eos is not None:
            ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
            cfg = dataclasses.replace(cfg, eos_token_ids=ids)
    return cfg


def safetensor_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files: from the index when sharded, else model.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index} is malformed: {e!r}") from None
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} names shard(s) that do not exist: {', '.join(missing)}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if found:
        return found
    pickled = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickled:
        raise ValueError(
            f"{path} holds only pickle-based weights ({', '.join(pickled)}); jaxllm never unpickles "
            "checkpoints (unpickling runs arbitrary code). Convert them to safetensors first.")
    raise ValueError(f"no model.safetensors (or index) in {path}")


class SafetensorsReader(contextlib.ExitStack):
    """All tensors of a (sharded) checkpoint by name: shapes up front, data on demand as numpy."""

    def __init__(self, files: list[Path]):
        super().__init__()
        self.handles, self.shapes = {}, {}
        cpu = jax.local_devices(backend="cpu")[0]  # this process's own (multi-host: not global 0)
        self._cpu = cpu
        for f in files:
            try:
                # framework="flax" reads bf16 (numpy alone cannot); it is pinned to the host CPU below.
                handle = self.enter_context(safe_open(str(f), framework="flax"))
                for name in handle.keys():
                    if name in self.handles:
                        raise ValueError(f"tensor {name} appears in two shards ({f.name})")
                    self.handles[name] = (f, handle)
                    self.shapes[name] = tuple(handle.get_slice(name).get_shape())
            except SafetensorError as e:
                raise ValueError(f"{f} is not a valid safetensors file: {e}") from None

    def get(self, name: str) -> np.ndarray:
        f, handle = self.handles[name]
        try:
            with jax.default_device(self._cpu):
                return np.asarray(handle.get_tensor(name))
        except SafetensorError as e:
            raise ValueError(f"{f}: tensor {name} could not be read ({e}); the file may be truncated") from None


def read_checkpoint(path: str | Path) -> tuple[ModelConfig, SafetensorsReader]:
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path} is not a checkpoint directory")
    return read_config(path), SafetensorsReader(safetensor_files(path))


def hf_state_dict_reader(tensors: dict[str, np.ndarray]) -> tuple[Callable[[str], np.ndarray], dict]:
    """(get, shapes) over an in-memory dict of HF-named arrays (GGUF files, tests)."""
    return tensors.__getitem__, {k: tuple(v.shape) for k, v in tensors.items()}
