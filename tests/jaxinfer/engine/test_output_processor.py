"""SampleState: detokenized text, stop strings split across tokens and steps, hold-back."""

from __future__ import annotations

import pytest

from jaxinfer.engine.output_processor import SampleState
from jaxinfer.model_loading import resolve_model_path
from jaxinfer.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_path("builtin:demo"))


def _feed(state, token_ids):
    """Adds tokens one at a time; returns the text shown after each."""
    shown = []
    for token in token_ids:
        if state.add([token]):
            break
        shown.append(state.text)
    return shown


def test_text_matches_decode_without_stops(tokenizer):
    ids = tokenizer.encode("Lists are mutable sequences, typically used to store items.",
                           add_special_tokens=False)
    state = SampleState(0, [1], tokenizer)
    _feed(state, ids)
    state.add([], finish_reason="length")
    output = state.output()
    assert output.text == tokenizer.decode(ids) and output.finish_reason == "length"
    assert output.token_ids == ids and output.stop_reason is None


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tokenizer, include):
    text = "Lists are mutable sequences, typically used to store items."
    ids = tokenizer.encode(text, add_special_tokens=False)
    stop = "able seq"  # inside "mutable sequences": spans a token boundary
    state = SampleState(0, [1], tokenizer, stop_strings=["zzz", stop],
                        include_stop_str_in_output=include)
    shown = _feed(state, ids)
    assert state.finished and state.finish_reason == "stop" and state.stop_reason == stop
    cut = text.index(stop) + (len(stop) if include else 0)
    assert state.text == text[:cut]
    # Nothing shown before the match reaches into the stop string.
    assert all(text[:cut].startswith(piece) or piece == "" for piece in shown)
    assert all(stop not in piece for piece in shown)
    assert len(state.token_ids) < len(ids)  # generation ended at the match


def test_hold_back_and_the_earliest_match_wins(tokenizer):
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    state = SampleState(0, [1], tokenizer, stop_strings=["four", "two"])
    shown = _feed(state, ids)
    assert state.text == "one " and state.stop_reason == "two"
    assert all(len(piece) <= len("one ") for piece in shown)


def test_finished_sample_ignores_more_tokens(tokenizer):
    state = SampleState(0, [1], tokenizer)
    state.add([5, 6], finish_reason="stop")
    assert state.stop_reason == 6 and not state.add([7])
    assert state.token_ids == [5, 6]
