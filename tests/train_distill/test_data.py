"""Corpus splits, tokenizer training, packing and the resumable loader."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer.tokenizer import load_tokenizer
from train_distill.corpus import build_corpus, is_validation, read_documents
from train_distill.data import LoaderState, PackedLoader, pack
from train_distill.prepare import prepare


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    summary = prepare(out, sources=["stdlib"], vocab_size=512, max_documents=60)
    return out, summary


def test_split_is_by_name_and_deterministic(tmp_path):
    first = build_corpus(tmp_path / "a", ["stdlib"], max_documents=60)
    second = build_corpus(tmp_path / "b", ["stdlib"], max_documents=60)
    assert first["splits"] == second["splits"]
    assert first["splits"]["validation"]["documents"] >= 0
    assert is_validation("x", 100.0) and not is_validation("x", 0.0)
    train = read_documents(tmp_path / "a" / "train.txt")
    assert len(train) == first["splits"]["train"]["documents"]


def test_tokenizer_round_trips_the_corpus(prepared):
    out, summary = prepared
    tokenizer = load_tokenizer(out / "tokenizer")
    assert tokenizer.vocab_size == 512 == summary["tokens"]["vocab_size"]
    document = read_documents(out / "corpus" / "train.txt")[0]
    ids = tokenizer.encode(document, add_special_tokens=False)
    assert tokenizer.decode(ids) == document  # indentation and newlines survive
    stream = np.load(out / "tokens" / "train.npy")
    assert stream.dtype == np.uint16 and stream[0] == tokenizer.bos_token_id
    assert stream.size == summary["tokens"]["splits"]["train"]


def test_pack_windows_overlap_by_one():
    stream = np.arange(23)
    windows = pack(stream, 5)
    assert windows.shape == (4, 6)
    np.testing.assert_array_equal(windows[1], [5, 6, 7, 8, 9, 10])
    with pytest.raises(ValueError, match="cannot fill one window"):
        pack(np.arange(3), 5)


def test_loader_is_deterministic_and_resumes_exactly():
    windows = np.arange(40)[:, None] * np.ones((1, 3), np.int64)  # [40, 3], row i holds i
    loader = PackedLoader(windows, batch_size=6, seed=1)
    uninterrupted = [loader.next_batch()[:, 0].tolist() for _ in range(15)]  # crosses epochs
    again = PackedLoader(windows, batch_size=6, seed=1)
    for _ in range(7):
        again.next_batch()
    saved = LoaderState(again.state.epoch, again.state.index)
    resumed = PackedLoader(windows, batch_size=6, seed=1, state=saved)
    assert [resumed.next_batch()[:, 0].tolist() for _ in range(8)] == uninterrupted[7:]
    epoch0 = [index for batch in uninterrupted[:6] for index in batch]
    assert len(set(epoch0)) == 36  # no window repeats within an epoch
    assert uninterrupted[0] != PackedLoader(windows, 6, seed=2).next_batch()[:, 0].tolist()
