"""The safetensors reader refuses malformed files and index entries that leave the directory.

Each hostile file is crafted byte by byte; the refusal must be a CheckpointFormatError that
names the file (and the tensor, where there is one).
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np
import pytest

from checkpoints.safetensors_io import (
    INDEX_FILE,
    MAX_HEADER_BYTES,
    SINGLE_FILE,
    CheckpointFiles,
    CheckpointFormatError,
    SafetensorsFile,
    write_safetensors,
)

_F32_PAIR = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


def _craft(path, header: object, data: bytes = b"\0" * 8, *, length: int | None = None):
    """Writes a safetensors file with this JSON `header` (raw bytes when given as bytes),
    data section and, if given, a lying header `length`."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


def test_round_trip_of_every_kind_of_tensor(tmp_path):
    tensors = {
        "bf16": np.arange(6, dtype=np.float32).reshape(2, 3).astype(ml_dtypes.bfloat16),
        "fp8": np.array([0.5, -2.0], ml_dtypes.float8_e4m3fn),
        "scalar": np.array(3, np.int64), "empty": np.zeros((0, 4), np.float16),
        "mask": np.array([True, False, True]),
    }
    write_safetensors(tmp_path / "x.safetensors", tensors, {"format": "pt"})
    handle = SafetensorsFile(tmp_path / "x.safetensors")
    assert handle.keys() == list(tensors) and handle.metadata == {"format": "pt"}
    for name, array in tensors.items():
        assert handle.shape(name) == array.shape
        got = handle.read(name)
        assert got.dtype == array.dtype
        np.testing.assert_array_equal(got, array)
    handle.close()


@pytest.mark.parametrize(("header", "data", "length", "message"), [
    # The 8-byte length is read before anything else: a huge one must not be allocated.
    ({}, b"", 1 << 62, "over the 100000000-byte limit"),
    ({}, b"", MAX_HEADER_BYTES + 1, "over the 100000000-byte limit"),
    ({"w": _F32_PAIR}, b"", 10_000, "runs past the end"),
    (b"{not json", b"", None, "not valid JSON"),
    (b"[" * 100_000 + b"]" * 100_000, b"", None, "not valid JSON"),  # recursion
    (b'{"w": {"dtype": "F32", "shape": [' + b"9" * 5000 + b"]}}", b"", None,
     "not valid JSON"),  # past Python's int digit limit
    (b"\xff\xfe{}", b"", None, "not valid JSON"),
    ([1, 2], b"", None, "header is list, not an object"),
    ({"__metadata__": "x", "w": _F32_PAIR}, b"\0" * 8, None, "__metadata__ is not an object"),
    ({"__metadata__": {"a": 1}, "w": _F32_PAIR}, b"\0" * 8, None,
     "__metadata__ is not an object"),
])
def test_malformed_header_is_refused(tmp_path, header, data, length, message):
    path = _craft(tmp_path / "bad.safetensors", header, data, length=length)
    with pytest.raises(CheckpointFormatError, match=message) as caught:
        SafetensorsFile(path)
    assert str(path) in str(caught.value)


@pytest.mark.parametrize(("entry", "message"), [
    ({"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, r"\[0, 16\] are not an ordered"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}, r"\[8, 0\] are not an ordered"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}, "not an ordered range"),
    ({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, "hold 8 bytes.*needs 12"),
    ({"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}, "not a list of non-negative"),
    ({"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}, "not a list of non-negative"),
    ({"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]}, "non-negative integers"),
    ({"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}, "not a list of non-negative"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [0, 8, 8]}, "are not two integers"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8]}, "are not two integers"),
    ({"dtype": "F32", "shape": [2]}, "are not two integers"),
    ({"dtype": "C128", "shape": [2], "data_offsets": [0, 8]}, "dtype 'C128', supported"),
    ({"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}, "has dtype"),
    ("F32", "header entry is str"),
])
def test_malformed_tensor_entry_is_refused_with_its_name(tmp_path, entry, message):
    path = _craft(tmp_path / "bad.safetensors", {"ok": _F32_PAIR, "model.w": entry})
    with pytest.raises(CheckpointFormatError, match=message) as caught:
        SafetensorsFile(path)
    assert f"{path}: tensor 'model.w'" in str(caught.value)


def test_offsets_count_from_the_data_section_not_the_file(tmp_path):
    # 8 data bytes: [0, 8] fits, [4, 12] does not, though the file has 8 + header bytes more.
    _craft(tmp_path / "ok.safetensors", {"w": _F32_PAIR})
    np.testing.assert_array_equal(SafetensorsFile(tmp_path / "ok.safetensors").read("w"), [0, 0])
    path = _craft(tmp_path / "bad.safetensors",
                  {"w": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})
    with pytest.raises(CheckpointFormatError, match="inside the 8-byte data section"):
        SafetensorsFile(path)


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_a_device_is_not_a_checkpoint_file():
    # Reads as a zero header length, then an endless data section; mapping it would fail.
    with pytest.raises(CheckpointFormatError, match="not a regular file"):
        SafetensorsFile("/dev/zero")


# ---------------------------------------------------------------- index files and paths


def _sharded(directory, weight_map: dict, shards=("a.safetensors",)):
    """A checkpoint directory with an index `weight_map` and real shards named `shards`."""
    directory.mkdir(parents=True, exist_ok=True)
    for shard in shards:
        write_safetensors(directory / shard, {"w": np.ones(2, np.float32)})
    (directory / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    return directory


def test_index_entries_resolve_inside_the_directory(tmp_path):
    directory = _sharded(tmp_path / "ckpt", {"w": "sub/a.safetensors"}, ())
    (directory / "sub").mkdir()
    write_safetensors(directory / "sub" / "a.safetensors", {"w": np.ones(2, np.float32)})
    (directory / "b.safetensors").symlink_to("sub/a.safetensors")  # a link inside is fine
    with CheckpointFiles(directory) as files:
        np.testing.assert_array_equal(files.read("w"), [1, 1])
    (directory / INDEX_FILE).write_text(json.dumps({"weight_map": {"w": "b.safetensors"}}))
    with CheckpointFiles(directory) as files:
        assert files.shape("w") == (2,)


@pytest.mark.parametrize("filename", ["../outside.safetensors", "sub/../../outside.safetensors",
                                      "ABSOLUTE"])
def test_index_entry_escaping_the_directory_is_refused(tmp_path, filename):
    outside = tmp_path / "outside.safetensors"
    write_safetensors(outside, {"w": np.ones(2, np.float32)})  # exists: refused all the same
    if filename == "ABSOLUTE":
        filename = str(outside)
    directory = _sharded(tmp_path / "ckpt", {"model.w": filename})
    (directory / "sub").mkdir()
    with pytest.raises(CheckpointFormatError, match=r"tensor 'model\.w'") as caught:
        CheckpointFiles(directory)
    assert str(directory / INDEX_FILE) in str(caught.value)


def test_index_entry_symlinked_out_of_the_directory_is_refused(tmp_path):
    write_safetensors(tmp_path / "secret.safetensors", {"w": np.ones(2, np.float32)})
    directory = _sharded(tmp_path / "ckpt", {"model.w": "a.safetensors",
                                             "model.v": "link.safetensors"})
    (directory / "link.safetensors").symlink_to(tmp_path / "secret.safetensors")
    with pytest.raises(CheckpointFormatError, match=r"'model.v'.*outside the checkpoint"):
        CheckpointFiles(directory)
    # A linked folder escapes just the same.
    (tmp_path / "elsewhere").mkdir()
    (directory / "folder").symlink_to(tmp_path / "elsewhere")
    (directory / INDEX_FILE).write_text(json.dumps({"weight_map": {"w": "folder/x"}}))
    with pytest.raises(CheckpointFormatError, match="outside the checkpoint"):
        CheckpointFiles(directory)


def test_single_file_symlinked_out_of_the_directory_is_refused(tmp_path):
    write_safetensors(tmp_path / "secret.safetensors", {"w": np.ones(2, np.float32)})
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / SINGLE_FILE).symlink_to(tmp_path / "secret.safetensors")
    with pytest.raises(CheckpointFormatError, match="outside the checkpoint"):
        CheckpointFiles(tmp_path / "ckpt")


def test_hugging_face_cache_snapshot_links_to_its_blobs(tmp_path):
    repo = tmp_path / "hub" / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    write_safetensors(repo / "blobs" / "3f2a", {"w": np.full(2, 7, np.float32)})
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (snapshot / "model-00001-of-00001.safetensors").symlink_to("../../blobs/3f2a")
    (snapshot / INDEX_FILE).write_text(json.dumps(
        {"weight_map": {"w": "model-00001-of-00001.safetensors"}}))
    with CheckpointFiles(snapshot) as files:
        np.testing.assert_array_equal(files.read("w"), [7, 7])
    # ... but only to its own repository's blobs.
    other = tmp_path / "hub" / "models--evil--x" / "blobs"
    other.mkdir(parents=True)
    write_safetensors(other / "9", {"w": np.ones(2, np.float32)})
    (snapshot / "model-00001-of-00001.safetensors").unlink()
    (snapshot / "model-00001-of-00001.safetensors").symlink_to(other / "9")
    with pytest.raises(CheckpointFormatError, match="outside the checkpoint"):
        CheckpointFiles(snapshot)


@pytest.mark.parametrize(("index", "message"), [
    ({"weight_map": {"model.w": 3}}, r"tensor 'model.w': file name 3 is not a string"),
    ({"weight_map": {"model.w": ""}}, r"tensor 'model.w': file name '' is not a relative"),
    ({"weight_map": ["a.safetensors"]}, 'no "weight_map" object'),
    ({"metadata": {}}, 'no "weight_map" object'),
    ([], 'no "weight_map" object'),
])
def test_malformed_index_is_refused(tmp_path, index, message):
    directory = _sharded(tmp_path / "ckpt", {})
    (directory / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointFormatError, match=message) as caught:
        CheckpointFiles(directory)
    assert str(directory / INDEX_FILE) in str(caught.value)


def test_index_naming_a_tensor_its_shard_lacks(tmp_path):
    directory = _sharded(tmp_path / "ckpt", {"w": "a.safetensors", "model.v": "a.safetensors"})
    with CheckpointFiles(directory) as files, pytest.raises(
            CheckpointFormatError, match=r"'model.v' is listed in 'a.safetensors', which does"):
        files.read("model.v")
