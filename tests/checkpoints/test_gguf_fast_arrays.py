"""`FastArrayReader` (metadata arrays read in one pass) gives exactly the fields gguf-py's own
element-by-element walk gives, and `shared_gguf_files` parses a file once per block."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from checkpoints.gguf_io import FastArrayReader, GGUFFile, open_gguf, shared_gguf_files

STRINGS = ["", "a", "Ġthe", "日本語のテキスト", "emoji 🤖🎉", "", "tab\tnew\nline\x00nul",
           "x" * 70_000, "Ġ Ġ", "ünïcödé " * 500, ""]


def _write(path, *, endianess: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE) -> None:
    """A GGUF file of metadata arrays of every kind (no tensors)."""
    writer = gguf.GGUFWriter(path, "llama", endianess=endianess)
    writer.add_array("test.strings", STRINGS)
    writer.add_array("test.one_string", ["only"])
    writer.add_array("test.int32", [3, -1, 0, 2**31 - 1])
    writer.add_array("test.float32", [0.5, -2.25, 1e-7])
    writer.add_array("test.bools", [True, False, True])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_string("test.after", "after the arrays")
    writer.add_uint32("test.number", 7)
    writer.add_token_list(["<s>", "▁hello", ""] * 1000)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


def _assert_same_fields(fast: gguf.GGUFReader, reference: gguf.GGUFReader) -> None:
    assert list(fast.fields) == list(reference.fields)
    for key, expected in reference.fields.items():
        field = fast.fields[key]
        assert (field.offset, field.name, field.data, field.types) == (
            expected.offset, expected.name, expected.data, expected.types), key
        assert len(field.parts) == len(expected.parts), key
        for part, expected_part in zip(field.parts, expected.parts):
            assert part.dtype == expected_part.dtype, key  # byte order included
            np.testing.assert_array_equal(part, expected_part, err_msg=key)
        assert field.contents() == expected.contents(), key
    assert fast.data_offset == reference.data_offset
    assert [tensor.name for tensor in fast.tensors] == [t.name for t in reference.tensors]


@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_fields_equal_gguf_py_on_a_written_file(tmp_path, endianess):
    path = tmp_path / "arrays.gguf"
    _write(path, endianess=endianess)
    fast, reference = FastArrayReader(path), gguf.GGUFReader(path)
    _assert_same_fields(fast, reference)
    assert fast.fields["test.strings"].contents() == STRINGS
    # The one-pass walk itself ran (not gguf-py's, should its hook have been renamed).
    assert "_get_field_parts" in vars(gguf.GGUFReader)
    strings = fast.fields["test.strings"]
    assert not isinstance(strings.parts[strings.data[0]], np.memmap)
    assert GGUFFile(path).metadata["test.strings"] == STRINGS


def test_fields_equal_gguf_py_on_smollm2(smollm2_gguf):
    fast, reference = FastArrayReader(smollm2_gguf), gguf.GGUFReader(smollm2_gguf)
    _assert_same_fields(fast, reference)
    assert len(fast.fields["tokenizer.ggml.tokens"].contents()) == 49152


def test_shared_block_parses_each_file_once(tmp_path, monkeypatch):
    path = tmp_path / "arrays.gguf"
    _write(path)
    parsed = []
    parse = FastArrayReader.__init__

    def counted_parse(reader, *args, **kwargs):
        parsed.append(args[0])
        parse(reader, *args, **kwargs)

    monkeypatch.setattr(FastArrayReader, "__init__", counted_parse)
    assert open_gguf(path) is not open_gguf(path)  # outside a block: a fresh parse each time
    assert len(parsed) == 2
    with shared_gguf_files():
        first = open_gguf(path)
        with shared_gguf_files():  # nested: the outer block's files
            assert open_gguf(tmp_path / "." / "arrays.gguf") is first
        assert open_gguf(str(path)) is first
        assert open_gguf(first) is first
    assert len(parsed) == 3
    assert open_gguf(path) is not first  # the block's files are not kept after it
    assert len(parsed) == 4
