"""Hugging Face checkpoint directories: config.json, generation_config.json and safetensors.

Only safetensors are read (no pickle): `.bin`/`.pt` checkpoints are refused with a message.
The `safetensors` library opens and checks each file; the tensors' bytes are then read straight
into their places in jaxllm's parameter arrays (`SafetensorsReader.read_into`), so no tensor is
copied on the host. Shapes are checked against the config before any data is read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from jaxllm import families
from jaxllm.model.config import ModelConfig, read_json_object

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def read_config(path: Path) -> ModelConfig:
    """ModelConfig from config.json, with stop ids from generation_config.json when present."""
    cfg = families.config_from_hf(path)  # the directory: a config.json that is itself one is named as such
    gen = path / "generation_config.json"
    if gen.exists():
        eos = read_json_object(gen).get("eos_token_id")
        if eos is not None:
            try:  # ModelConfig checks each id
                cfg = dataclasses.replace(cfg, eos_token_ids=tuple(eos if isinstance(eos, list) else [eos]))
            except ValueError as e:
                raise ValueError(f"{gen}: eos_token_id: {e}") from None
    return cfg


def safetensor_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files: from the index when sharded, else model.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json_object(index).get("weight_map")
        if not (isinstance(weight_map, dict) and all(isinstance(f, str) for f in weight_map.values())):
            raise ValueError(f"{index} is malformed: weight_map must map tensor names to file names, "
                             f"not {str(weight_map)[:100]}")
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ValueError(f"{index} names shard(s) that do not exist: {', '.join(missing)}")
        return files
    single = path / "model.safetensors"
    if single.exists():
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


# safetensors' dtype names as numpy holds them (bfloat16 and float8 from ml_dtypes).
_DTYPES = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64,
           "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
           "I8": np.int8, "U8": np.uint8, "I16": np.int16, "U16": np.uint16, "I32": np.int32,
           "U32": np.uint32, "I64": np.int64, "U64": np.uint64, "BOOL": np.bool_}
READ_PIECE = 1 << 28  # bytes a read asks for: Linux returns at most ~2 GiB from one


class SafetensorsReader(contextlib.ExitStack):
    """All tensors of a (sharded) checkpoint by name: shapes and dtypes up front, data on demand.

    The library opens and checks each file (its header, every tensor's extent). The data is then
    read with plain positional reads (`os.preadv`) straight into the caller's array, or a slice of
    it (`read_into`). The library's own numpy reader copies out of a memory map page by page
    instead, a few times slower (docs/decisions/loading.md#reads-straight-into-place). Reads share
    no file position, so threads may read at once.
    """

    def __init__(self, files: list[Path]):
        super().__init__()
        self.shapes, self._extents = {}, {}
        for number, f in enumerate(files):
            if not f.is_file():  # a directory fails oddly, a FIFO blocks safe_open forever
                raise ValueError(f"{f} is not a regular file")
            try:
                handle = self.enter_context(safe_open(str(f), framework="numpy"))
                for name in handle.keys():
                    if name in self.shapes:
                        raise ValueError(f"tensor {name} appears in two shards ({f.name})")
                    self.shapes[name] = tuple(handle.get_slice(name).get_shape())
            except SafetensorError as e:
                raise ValueError(f"{f} is not a valid safetensors file: {e}") from None
            fd = os.open(f, os.O_RDONLY)
            self.callback(os.close, fd)
            self._extents.update(_extents(f, number, fd))

    def dtype(self, name: str) -> np.dtype:
        f, _, _, dtype, _, _ = self._extents[name]
        if dtype not in _DTYPES:
            raise ValueError(f"{f}: tensor {name} is of dtype {dtype}, which jaxllm cannot read")
        return np.dtype(_DTYPES[dtype])

    def position(self, name: str) -> tuple[int, int]:
        """Where the tensor's bytes lie: (the file's number, its first byte)."""
        _, number, _, _, at, _ = self._extents[name]
        return number, at

    def get(self, name: str) -> np.ndarray:
        out = np.empty(self.shapes[name], self.dtype(name))
        self.read_into(name, out)
        return out

    def read_into(self, name: str, view: np.ndarray):
        """Read the tensor into `view`, an array (or a slice of one) of its size, in C order."""
        f, _, fd, _, at, end = self._extents[name]
        if view.dtype != self.dtype(name):  # a parameter whose sources differ in dtype
            np.copyto(view, self.get(name).reshape(view.shape))
            return
        if view.nbytes != end - at:
            raise ValueError(f"{f}: tensor {name} holds {end - at} bytes, not the {view.nbytes} of "
                             f"its shape {self.shapes[name]} in {self.dtype(name)}")
        for run in contiguous_runs(view):
            for done in range(0, len(run), READ_PIECE):
                piece = run[done:done + READ_PIECE]
                got = os.preadv(fd, [piece], at + done)
                while got < len(piece):  # a short read: go on from there, or the file ended early
                    more = os.preadv(fd, [piece[got:]], at + done + got)
                    if not more:
                        raise ValueError(f"{f}: tensor {name} could not be read (the file ends "
                                         "early); the file may be truncated")
                    got += more
            at += len(run)


def contiguous_runs(view: np.ndarray) -> list[np.ndarray]:
    """The view's memory as byte arrays, in its C order: one when it is contiguous, else one per
    index of the leading axes over which it is not (a slice of a parameter's middle axis)."""
    if view.size == 0:
        return []
    lead = next(a for a in range(view.ndim + 1) if view[(0,) * a + (...,)].flags.c_contiguous)
    return [view[index + (...,)].reshape(-1).view(np.uint8) for index in np.ndindex(view.shape[:lead])]


class ArraySource:
    """Arrays already in memory (a dequantized GGUF file, tests), read as a checkpoint is."""

    def __init__(self, tensors: dict[str, np.ndarray]):
        self.tensors = tensors
        self.shapes = {k: tuple(v.shape) for k, v in tensors.items()}
        self._numbers = {k: i for i, k in enumerate(tensors)}

    def dtype(self, name: str) -> np.dtype:
        return self.tensors[name].dtype

    def position(self, name: str) -> tuple[int, int]:
        return 0, self._numbers[name]

    def read_into(self, name: str, view: np.ndarray):
        np.copyto(view, self.tensors[name].reshape(view.shape))


def _extents(f: Path, number: int, fd: int) -> dict[str, tuple[Path, int, int, str, int, int]]:
    """name -> (file, its number, fd, dtype, first byte, end) of each tensor of an open
    safetensors file, from its header (8 bytes of length, then JSON), which the library has
    already checked."""
    (length,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    header = json.loads(os.pread(fd, length, 8))
    return {name: (f, number, fd, t["dtype"], 8 + length + t["data_offsets"][0],
                   8 + length + t["data_offsets"][1])
            for name, t in header.items() if name != "__metadata__"}


class RenamedSource(contextlib.AbstractContextManager):
    """Some of a source's tensors under other names (`names`: the name given -> the name stored):
    the text model of a multimodal checkpoint, its vision tower left out."""

    def __init__(self, source, names: dict[str, str]):
        self.source, self._stored = source, names
        self.shapes = {name: source.shapes[stored] for name, stored in names.items()}

    def dtype(self, name: str) -> np.dtype:
        return self.source.dtype(self._stored[name])

    def position(self, name: str) -> tuple[int, int]:
        return self.source.position(self._stored[name])

    def read_into(self, name: str, view: np.ndarray) -> None:
        self.source.read_into(self._stored[name], view)

    def __exit__(self, *exc):
        return self.source.__exit__(*exc)


def read_checkpoint(path: str | Path) -> tuple[ModelConfig, SafetensorsReader | RenamedSource]:
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path} is not a checkpoint directory")
    cfg, reader = read_config(path), SafetensorsReader(safetensor_files(path))
    names = families.text_tensor_names(read_json_object(path / "config.json"), reader.shapes)
    return cfg, reader if names is None else RenamedSource(reader, names)
