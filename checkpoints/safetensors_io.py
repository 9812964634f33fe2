"""Reading and writing the safetensors format with NumPy only (bfloat16 via ml_dtypes).

A safetensors file is an 8-byte little-endian header length, a JSON header mapping each tensor
name to its dtype, shape and byte range, then the raw bytes. We read through a memory map, so
opening a 100 GB checkpoint costs nothing and each tensor is read only when asked for. The
`safetensors` package's NumPy API cannot return bfloat16, which most checkpoints use; this one
can.

A Hugging Face checkpoint is either one `model.safetensors` or several shards listed in
`model.safetensors.index.json` ("weight_map": tensor name -> file). `CheckpointFiles` hides
which.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointFormatError(ValueError):
    """A checkpoint file is malformed or holds something we cannot read."""


class SafetensorsFile:
    """One memory-mapped safetensors file; tensors are read on demand."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as handle:
            size_bytes = handle.read(8)
            if len(size_bytes) != 8:
                raise CheckpointFormatError(f"{self.path}: too short to be safetensors")
            (header_size,) = struct.unpack("<Q", size_bytes)
            header = json.loads(handle.read(header_size))
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        self._data_start = 8 + header_size
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._entries: dict[str, dict[str, Any]] = header

    def keys(self) -> list[str]:
        """Tensor names in this file."""
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of tensor `name` without reading it."""
        return tuple(self._entries[name]["shape"])

    def read(self, name: str) -> np.ndarray:
        """Returns tensor `name` as a NumPy array (a copy, independent of the file)."""
        entry = self._entries[name]
        dtype_name = entry["dtype"]
        if dtype_name not in _DTYPES:
            raise CheckpointFormatError(f"{self.path}: tensor {name!r} has dtype {dtype_name}, "
                                        f"supported: {sorted(_DTYPES)}")
        start, end = entry["data_offsets"]
        buffer = self._map[self._data_start + start:self._data_start + end]
        return np.frombuffer(buffer, dtype=_DTYPES[dtype_name]).reshape(entry["shape"])

    def close(self) -> None:
        """Releases the memory map."""
        self._map.close()


def write_safetensors(path: str | os.PathLike[str], tensors: Mapping[str, np.ndarray],
                      metadata: Mapping[str, str] | None = None) -> None:
    """Writes `tensors` to one safetensors file, streaming one tensor at a time."""
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name, array in tensors.items():
        if array.dtype not in _NAMES:
            raise CheckpointFormatError(f"tensor {name!r}: dtype {array.dtype} not writable")
        header[name] = {"dtype": _NAMES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format aligns the data section to 8 bytes
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        for array in tensors.values():
            handle.write(np.ascontiguousarray(array).tobytes())


class CheckpointFiles:
    """All tensors of a Hugging Face checkpoint directory, single-file or sharded."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        index_path = self.directory / INDEX_FILE
        single_path = self.directory / SINGLE_FILE
        self._files: dict[str, SafetensorsFile] = {}
        if index_path.exists():
            weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
            self._location = dict(weight_map)
        elif single_path.exists():
            self._location = {name: SINGLE_FILE for name in self._open(SINGLE_FILE).keys()}
        else:
            raise FileNotFoundError(
                f"{self.directory}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors "
                f"checkpoints are supported)")

    def _open(self, filename: str) -> SafetensorsFile:
        if filename not in self._files:
            path = self.directory / filename
            if not path.exists():
                raise FileNotFoundError(f"{path}: listed in {INDEX_FILE} but missing")
            self._files[filename] = SafetensorsFile(path)
        return self._files[filename]

    def __contains__(self, name: object) -> bool:
        return name in self._location

    def __iter__(self) -> Iterator[str]:
        return iter(self._location)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of tensor `name` without reading it."""
        return self._open(self._location[name]).shape(name)

    def read(self, name: str) -> np.ndarray:
        """Reads tensor `name` from whichever shard holds it."""
        return self._open(self._location[name]).read(name)

    def close(self) -> None:
        """Releases every open shard."""
        for handle in self._files.values():
            handle.close()
        self._files.clear()

    def __enter__(self) -> CheckpointFiles:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
