"""SampleState: detokenized text, stop strings split across tokens and steps, hold-back;
deltas (unit and through a real engine): concatenated, they are the cumulative output."""

from __future__ import annotations

import itertools

import pytest

from jaxinfer.engine.core import Engine, EngineConfig
from jaxinfer.engine.host.draft import SpecStats
from jaxinfer.engine.output_processor import SampleState
from jaxinfer.engine.outputs import CompletionOutput, RequestOutput
from jaxinfer.engine.sampling_params import RequestOutputKind, SamplingParams
from jaxinfer.model_loading import load_model, resolve_model_path
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


# ---------------------------------------------------------------------- deltas, unit


def test_delta_without_a_tokenizer_reports_each_token_once():
    state = SampleState(0, [1], None)
    assert state.delta() is None  # nothing yet
    state.add([5, 6], logprobs=[{5: -0.5}, {6: -0.25, 9: -2.0}])
    first = state.delta()
    assert (first.text, first.token_ids, first.finish_reason) == ("", [5, 6], None)
    assert first.logprobs == [{5: -0.5}, {6: -0.25, 9: -2.0}]
    assert state.delta() is None  # nothing new since
    state.add([7], logprobs=[{7: -1.0}])
    assert (state.delta().token_ids, state.output().token_ids) == ([7], [5, 6, 7])
    state.add([], finish_reason="length")  # finishing without new tokens is still news
    last = state.delta()
    assert (last.token_ids, last.logprobs, last.finish_reason) == ([], [], "length")
    assert state.delta() is None and not state.add([8])
    assert state.output() == CompletionOutput(0, "", [5, 6, 7], "length", None,
                                              [{5: -0.5}, {6: -0.25, 9: -2.0}, {7: -1.0}])


def test_delta_of_a_stop_token_carries_the_token_and_the_reason():
    state = SampleState(1, [1], None)
    state.add([5])
    state.delta()
    state.add([2], finish_reason="stop")
    delta = state.delta()
    assert (delta.index, delta.token_ids, delta.logprobs) == (1, [2], None)
    assert (delta.finish_reason, delta.stop_reason) == ("stop", 2)


def test_text_deltas_concatenate_and_never_reach_into_a_stop_string(tokenizer):
    text = "Lists are mutable sequences, typically used to store items."
    ids = tokenizer.encode(text, add_special_tokens=False)
    stop = "able seq"
    state = SampleState(0, [1], tokenizer, stop_strings=[stop])
    deltas = []
    for token in ids:
        stopped = state.add([token])
        if (delta := state.delta()) is not None:
            deltas.append(delta)
        if stopped:
            break
    assert "".join(delta.text for delta in deltas) == state.text == text[:text.index(stop)]
    assert list(itertools.chain(*(delta.token_ids for delta in deltas))) == state.token_ids
    assert [delta.finish_reason for delta in deltas].count("stop") == 1
    assert deltas[-1].stop_reason == stop
    assert all(stop[:2] not in delta.text for delta in deltas)  # held back, never shown


def test_request_output_add_accumulates_deltas():
    spec = SpecStats(num_spec_steps=1, num_draft_tokens=3, num_accepted_tokens=2)
    output = RequestOutput("r", "p", [1, 2], [])
    # Sample 1 reports before sample 0: the samples still end up in index order.
    output.add(RequestOutput("r", "p", [1, 2], [CompletionOutput(1, "b", [7])],
                             prompt_logprobs=[None, {2: -0.5}]))
    output.add(RequestOutput("r", "p", [1, 2], [CompletionOutput(0, "a", [5], logprobs=[
        {5: -0.1}])]))
    snapshot = output.snapshot()
    output.add(RequestOutput("r", "p", [1, 2], [
        CompletionOutput(0, "c", [6], "stop", "c", [{6: -0.2}]),
        CompletionOutput(1, "d", [8], "length")], finished=True, speculative=spec))
    assert output == RequestOutput(
        "r", "p", [1, 2], [CompletionOutput(0, "ac", [5, 6], "stop", "c",
                                            [{5: -0.1}, {6: -0.2}]),
                           CompletionOutput(1, "bd", [7, 8], "length")],
        finished=True, prompt_logprobs=[None, {2: -0.5}], speculative=spec)
    # The snapshot taken earlier is untouched by the later add.
    assert snapshot.outputs[0] == CompletionOutput(0, "a", [5], logprobs=[{5: -0.1}])
    assert snapshot.outputs[1] == CompletionOutput(1, "b", [7]) and not snapshot.finished


# ---------------------------------------------------------------------- deltas, end to end

PROMPT = "The list type"


@pytest.fixture(scope="module")
def demo_engine(tokenizer):
    model = load_model("builtin:demo")
    config = EngineConfig.from_options(page_size=8, max_num_batched_tokens=64, max_num_seqs=16,
                                       max_model_len=96, enable_prompt_logprobs=True)
    return Engine(model, config, tokenizer)


def _run(engine):
    """Steps until idle; returns every output of each request, in order."""
    history = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            history.setdefault(output.request_id, []).append(output)
    assert engine.num_free_pages == engine.config.num_pages - 1  # nothing leaked
    return history


def _comparable(output):
    """Everything a user sees of an output but its id."""
    return (output.prompt, output.prompt_token_ids, output.finished, output.prompt_logprobs,
            [(sample.index, sample.text, sample.token_ids, sample.finish_reason,
              sample.stop_reason, sample.logprobs) for sample in output.outputs])


def _workload(stop):
    """Requests exercising each part of the output: seeded so that every output kind of a
    request samples the same tokens."""
    greedy = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
    return {
        "stop": dict(greedy, stop=["never seen", stop]),
        "stop-included": dict(greedy, stop=[stop], include_stop_str_in_output=True),
        "n2": dict(n=2, seed=5, temperature=0.9, max_tokens=12),
        "logprobs": dict(logprobs=2, seed=3, temperature=0.8, max_tokens=10),
        "prompt-logprobs": dict(prompt_logprobs=1, seed=1, temperature=0.8, max_tokens=6),
        "min-tokens": dict(min_tokens=8, max_tokens=12, seed=2, temperature=1.0,
                           stop_token_ids=[13]),
    }


def test_deltas_concatenate_to_the_cumulative_output(demo_engine, tokenizer):
    engine = demo_engine
    engine.add_request("free", PROMPT, SamplingParams(temperature=0.0, max_tokens=24,
                                                      ignore_eos=True))
    text = _run(engine)["free"][-1].outputs[0].text
    start = len(text) // 3
    stop = text[start:start + 7]  # most likely starts inside one token and ends in another
    assert stop.strip() and text.find(stop) == start

    kinds = {"c": RequestOutputKind.CUMULATIVE, "d": RequestOutputKind.DELTA,
             "f": RequestOutputKind.FINAL_ONLY}
    workload = _workload(stop)
    for name, params in workload.items():
        for suffix, kind in kinds.items():
            engine.add_request(f"{name}/{suffix}", PROMPT,
                               SamplingParams(**params, output_kind=kind))
    history = _run(engine)

    for name in workload:
        cumulative, deltas, final = (history[f"{name}/{suffix}"] for suffix in kinds)
        expected = _comparable(cumulative[-1])
        assert cumulative[-1].finished and not any(output.finished
                                                   for output in cumulative[:-1])
        # FINAL_ONLY: one output, at the end, equal to the last cumulative one.
        assert len(final) == 1 and _comparable(final[0]) == expected
        # DELTA: folding the deltas gives the cumulative output.
        folded = RequestOutput(deltas[0].request_id, deltas[0].prompt,
                               deltas[0].prompt_token_ids, [])
        for delta in deltas:
            folded.add(delta)
        assert _comparable(folded) == expected, name
        assert deltas[-1].finished and not any(delta.finished for delta in deltas[:-1])
        # Prompt logprobs come once; they were asked for by one request only.
        sent = [delta.prompt_logprobs for delta in deltas if delta.prompt_logprobs is not None]
        assert sent == ([cumulative[-1].prompt_logprobs] if name == "prompt-logprobs" else [])
        for index, sample in enumerate(cumulative[-1].outputs):
            pieces = [piece for delta in deltas for piece in delta.outputs
                      if piece.index == index]
            # Each delta holds only what is new: the texts concatenate to the text (nothing
            # repeated), each piece says something, and only the last one finishes.
            assert "".join(piece.text for piece in pieces) == sample.text
            assert all(piece.text or piece.token_ids or piece.finish_reason
                       for piece in pieces)
            assert [piece.finish_reason is not None for piece in pieces] == (
                [False] * (len(pieces) - 1) + [True])
            shown = [output.outputs[index].text for output in cumulative]
            assert all(later.startswith(earlier)
                       for earlier, later in itertools.pairwise(shown))

    # What each request was for actually happened.
    stopped = history["stop/c"][-1].outputs[0]
    assert (stopped.text, stopped.finish_reason, stopped.stop_reason) == (
        text[:start], "stop", stop)
    assert history["stop-included/c"][-1].outputs[0].text == text[:start + len(stop)]
    assert len(history["n2/c"][-1].outputs) == 2
    assert all(len(entry) >= 1 for entry in history["logprobs/c"][-1].outputs[0].logprobs)
    assert len(history["prompt-logprobs/c"][-1].prompt_logprobs) == len(
        tokenizer.encode(PROMPT))
    assert len(history["min-tokens/c"][-1].outputs[0].token_ids) >= 8


def test_abort_in_delta_mode_ends_with_an_abort_delta(demo_engine):
    engine = demo_engine
    params = SamplingParams(n=2, seed=4, temperature=0.8, max_tokens=40, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    engine.add_request("aborted", PROMPT, params)
    deltas = []
    while not any(piece.token_ids for delta in deltas for piece in delta.outputs):
        deltas += engine.step()
    final = engine.abort_request("aborted")
    assert final.finished and [piece.finish_reason for piece in final.outputs] == [
        "abort", "abort"]
    assert engine.abort_request("aborted") is None and not engine.has_unfinished_requests()
    folded = RequestOutput("aborted", PROMPT, final.prompt_token_ids, [])
    for delta in [*deltas, final]:
        folded.add(delta)
    assert folded.finished and all(sample.finish_reason == "abort"
                                   for sample in folded.outputs)
    assert sum(len(sample.token_ids) for sample in folded.outputs) >= 1
