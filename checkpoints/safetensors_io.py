"""Reading and writing the safetensors format with NumPy only (bfloat16 via ml_dtypes).

A safetensors file is an 8-byte little-endian header length, a JSON header mapping each tensor
name to its dtype, shape and byte range, then the raw bytes. We read through a memory map, so
opening a 100 GB checkpoint costs nothing and each tensor is read only when asked for.

A checkpoint is input from outside (a download, a clone), so opening one checks everything
the header says before any byte is trusted, as the `safetensors` library does: the header is
at most `MAX_HEADER_BYTES` (the library's bound) and lies inside the file; it is a JSON object;
every tensor has a known dtype, a shape of non-negative integers and `data_offsets`
[begin, end] inside the data section whose length is exactly the shape's byte size;
`__metadata__` maps strings to strings. Unlike the library we do not require the tensors to
tile the data section without gaps: a gap or an overlap reads nothing outside the file. Every
violation is a `CheckpointFormatError` naming the file and the tensor.

Why not the `safetensors` library (measured with safetensors 0.8.0): its NumPy API looks
dtypes up by NumPy name, so it returns bfloat16, which most checkpoints use, only after
something has imported ml_dtypes (otherwise "data type 'bfloat16' not understood"), and the
float8 dtypes not at all; several of its errors do not name the tensor ("invalid shape, data
type, or offset for tensor"); and it is no dependency of ours (only of transformers, in the
tests). The checks above are all this reader adds to what it needs anyway.

A Hugging Face checkpoint is either one `model.safetensors` or several shards listed in
`model.safetensors.index.json` ("weight_map": tensor name -> file). `CheckpointFiles` hides
which, and opens only files inside the checkpoint directory (see `CheckpointFiles`).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import stat
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
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# The `safetensors` library's bound (MAX_HEADER_SIZE); a real header is a few hundred KB.
MAX_HEADER_BYTES = 100_000_000
_METADATA = "__metadata__"


class CheckpointFormatError(ValueError):
    """A checkpoint file is malformed or holds something we cannot read."""


def _is_int(value: object) -> bool:
    """A JSON integer: `bool` is an `int` subclass in Python, but `true` is no size."""
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_json(raw: bytes, where: str) -> Any:
    """`raw` as JSON; any failure (bad UTF-8 or syntax, an integer past Python's digit limit,
    nesting past the recursion limit) becomes a CheckpointFormatError about `where`."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as error:  # JSONDecodeError, UnicodeDecodeError too
        raise CheckpointFormatError(f"{where}: not valid JSON ({error})") from None


def _check_entry(where: str, name: str, entry: object, data_bytes: int) -> dict[str, Any]:
    """Validates one tensor's header entry against the `data_bytes` of the data section.

    Returns:
        The entry, with `shape` as a tuple of ints.
    """
    prefix = f"{where}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise CheckpointFormatError(f"{prefix}: header entry is {type(entry).__name__}, "
                                    "not an object")
    dtype_name = entry.get("dtype")
    if not isinstance(dtype_name, str) or dtype_name not in _DTYPES:
        raise CheckpointFormatError(f"{prefix} has dtype {dtype_name!r}, supported: "
                                    f"{sorted(_DTYPES)}")
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(_is_int(size) and size >= 0 for size in shape):
        raise CheckpointFormatError(f"{prefix}: shape {shape!r} is not a list of "
                                    "non-negative integers")
    offsets = entry.get("data_offsets")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(_is_int(offset) for offset in offsets)):
        raise CheckpointFormatError(f"{prefix}: data_offsets {offsets!r} are not two integers")
    begin, end = offsets
    if not 0 <= begin <= end <= data_bytes:
        raise CheckpointFormatError(
            f"{prefix}: data_offsets [{begin}, {end}] are not an ordered range inside the "
            f"{data_bytes}-byte data section (the file is truncated or corrupt)")
    expected = math.prod(shape) * _DTYPES[dtype_name].itemsize  # Python ints: no overflow
    if end - begin != expected:
        raise CheckpointFormatError(
            f"{prefix}: data_offsets [{begin}, {end}] hold {end - begin} bytes, but shape "
            f"{shape} of {dtype_name} needs {expected}")
    return {"dtype": dtype_name, "shape": tuple(shape), "data_offsets": (begin, end)}


class SafetensorsFile:
    """One memory-mapped safetensors file; tensors are read on demand.

    Raises (from the constructor):
        CheckpointFormatError: Anything in the file the module docstring's checks refuse.
        OSError: The file cannot be opened.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as handle:
            status = os.fstat(handle.fileno())
            if not stat.S_ISREG(status.st_mode):
                raise CheckpointFormatError(f"{self.path}: not a regular file")
            file_bytes = status.st_size
            size_bytes = handle.read(8)
            if len(size_bytes) != 8:
                raise CheckpointFormatError(f"{self.path}: too short to be safetensors")
            (header_size,) = struct.unpack("<Q", size_bytes)
            if header_size > MAX_HEADER_BYTES:
                raise CheckpointFormatError(
                    f"{self.path}: header length {header_size} is over the "
                    f"{MAX_HEADER_BYTES}-byte limit (not safetensors, or corrupt)")
            if 8 + header_size > file_bytes:
                raise CheckpointFormatError(
                    f"{self.path}: header length {header_size} runs past the end of the "
                    f"{file_bytes}-byte file (truncated or corrupt)")
            header = _parse_json(handle.read(header_size), f"{self.path}: header")
            if not isinstance(header, dict):
                raise CheckpointFormatError(f"{self.path}: header is "
                                            f"{type(header).__name__}, not an object")
            metadata = header.pop(_METADATA, None) or {}
            if not isinstance(metadata, dict) or not all(
                    isinstance(value, str) for value in metadata.values()):
                raise CheckpointFormatError(f"{self.path}: {_METADATA} is not an object of "
                                            "strings to strings")
            data_bytes = file_bytes - 8 - header_size
            self._entries: dict[str, dict[str, Any]] = {
                name: _check_entry(str(self.path), name, entry, data_bytes)
                for name, entry in header.items()}
            # mmap refuses an empty mapping; a file of only a header has nothing to map.
            self._map = (mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
                         if file_bytes else None)
        self._data_start = 8 + header_size
        self.metadata: dict[str, str] = metadata

    def keys(self) -> list[str]:
        """Tensor names in this file."""
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of tensor `name` without reading it."""
        return self._entries[name]["shape"]

    def read(self, name: str) -> np.ndarray:
        """Returns tensor `name` as a NumPy array (a copy, independent of the file)."""
        entry = self._entries[name]
        start, end = entry["data_offsets"]
        buffer = self._map[self._data_start + start:self._data_start + end] if self._map else b""
        return np.frombuffer(buffer, dtype=_DTYPES[entry["dtype"]]).reshape(entry["shape"])

    def close(self) -> None:
        """Releases the memory map."""
        if self._map is not None:
            self._map.close()


def write_safetensors(path: str | os.PathLike[str], tensors: Mapping[str, np.ndarray],
                      metadata: Mapping[str, str] | None = None) -> None:
    """Writes `tensors` to one safetensors file, streaming one tensor at a time."""
    header: dict[str, Any] = {_METADATA: dict(metadata or {"format": "pt"})}
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


def _allowed_roots(directory: Path) -> tuple[Path, ...]:
    """Where the files of checkpoint `directory` (resolved) may really live: the directory,
    and for a Hugging Face hub cache snapshot (`models--ORG--NAME/snapshots/REV/...`, whose
    files are symlinks to `../../blobs/HASH`) that repository's `blobs` folder."""
    roots = [directory]
    for ancestor in directory.parents:
        if ancestor.name == "snapshots" and ancestor.parent.name.startswith("models--"):
            roots.append(ancestor.parent / "blobs")
            break
    return tuple(roots)


class CheckpointFiles:
    """All tensors of a Hugging Face checkpoint directory, single-file or sharded.

    Every weight file must resolve (symlinks followed) to a regular file inside the directory,
    or, in a Hugging Face hub cache snapshot, inside its repository's `blobs` folder: an index
    naming `../x`, an absolute path, or a symlink out of the directory is refused, so a
    downloaded checkpoint cannot make the loader read files elsewhere on the host.

    Raises (from the constructor):
        FileNotFoundError: Neither weight file layout is there.
        CheckpointFormatError: The index is malformed or names a file outside the directory.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self._roots = _allowed_roots(self.directory.resolve())
        index_path = self.directory / INDEX_FILE
        single_path = self.directory / SINGLE_FILE
        self._files: dict[str, SafetensorsFile] = {}
        if index_path.exists():
            self._location = self._read_index(index_path)
        elif single_path.exists():
            self._location = {name: SINGLE_FILE for name in self._open(SINGLE_FILE).keys()}
        else:
            raise FileNotFoundError(
                f"{self.directory}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors "
                f"checkpoints are supported)")

    def _read_index(self, index_path: Path) -> dict[str, str]:
        """The index's weight_map, each file name checked (see the class docstring)."""
        if index_path.stat().st_size > MAX_HEADER_BYTES:  # a real one is well under 1 MB
            raise CheckpointFormatError(f"{index_path}: over {MAX_HEADER_BYTES} bytes")
        index = _parse_json(index_path.read_bytes(), str(index_path))
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointFormatError(f"{index_path}: no \"weight_map\" object")
        for name, filename in weight_map.items():
            if not isinstance(filename, str):
                raise CheckpointFormatError(f"{index_path}: tensor {name!r}: file name "
                                            f"{filename!r} is not a string")
            self._resolve(filename, f"{index_path}: tensor {name!r}")
        return dict(weight_map)

    def _resolve(self, filename: str, where: str) -> Path:
        """The real path of weight file `filename`, which must stay inside the checkpoint."""
        if not filename or Path(filename).is_absolute():
            raise CheckpointFormatError(f"{where}: file name {filename!r} is not a relative "
                                        "path inside the checkpoint directory")
        path = (self.directory / filename).resolve()
        if not any(path.is_relative_to(root) for root in self._roots):
            raise CheckpointFormatError(
                f"{where}: file {filename!r} resolves to {path}, outside the checkpoint "
                f"directory {self._roots[0]} (copy the file in rather than linking to it)")
        return path

    def _open(self, filename: str) -> SafetensorsFile:
        if filename not in self._files:
            path = self._resolve(filename, str(self.directory))
            if not path.exists():
                raise FileNotFoundError(f"{self.directory / filename}: listed in {INDEX_FILE} "
                                        "but missing")
            self._files[filename] = SafetensorsFile(path)
        return self._files[filename]

    def __contains__(self, name: object) -> bool:
        return name in self._location

    def __iter__(self) -> Iterator[str]:
        return iter(self._location)

    def _shard(self, name: str) -> SafetensorsFile:
        """The open file holding tensor `name` (KeyError: no such tensor)."""
        filename = self._location[name]
        shard = self._open(filename)
        if name not in shard:
            raise CheckpointFormatError(f"{self.directory / INDEX_FILE}: tensor {name!r} is "
                                        f"listed in {filename!r}, which does not hold it")
        return shard

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of tensor `name` without reading it."""
        return self._shard(name).shape(name)

    def read(self, name: str) -> np.ndarray:
        """Reads tensor `name` from whichever shard holds it."""
        return self._shard(name).read(name)

    def close(self) -> None:
        """Releases every open shard."""
        for handle in self._files.values():
            handle.close()
        self._files.clear()

    def __enter__(self) -> CheckpointFiles:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
