"""A failure in one request's host work inside a step fails that request alone.

Failures are injected where the engine does per-request host work: packing the step's
sampling arrays (`build_sampling_arrays`, as the runner calls it) and the output processor's
per-sample update (`SampleState.add`: detokenizing, stop strings). The failing request ends
with finish_reason "error" and its `error`; every other request of the same batches gets
exactly the tokens it gets without the failure; the pages all come back and the engine keeps
serving. A failure of the device step itself still raises (the engine is dead then).
"""

from __future__ import annotations

import pytest

from jaxinfer.config import get_preset
from jaxinfer.engine.core import Engine, EngineConfig
from jaxinfer.engine.device import runner as runner_module
from jaxinfer.engine.output_processor import SampleState
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.models import create_model

PROMPTS = {"a": [1, 5, 9, 200], "b": [1, 300, 301, 302, 303, 304, 305], "c": [1, 42],
           "d": [1, 7, 7, 7, 7, 7]}
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model():
    return create_model(get_preset("tiny"), seed=0)


def _engine(model) -> Engine:
    return Engine(model, EngineConfig.from_options(
        page_size=4, max_num_batched_tokens=32, max_num_seqs=8, max_model_len=64,
        enable_prompt_logprobs=False, enable_prefix_caching=True))


def _greedy(n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=n)


def _run(engine: Engine, params: dict[str, SamplingParams]) -> dict[str, object]:
    """Adds one request per prompt (with its params), steps until done; the final outputs."""
    for request_id, prompt in PROMPTS.items():
        engine.add_request(request_id, prompt, params.get(request_id, _greedy()))
    final = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output
    return final


@pytest.fixture(scope="module")
def expected(model):
    """Each request's tokens when nothing fails."""
    final = _run(_engine(model), {})
    return {request_id: output.outputs[0].token_ids for request_id, output in final.items()}


def _idle(engine: Engine) -> bool:
    return (not engine.has_unfinished_requests() and not engine.scheduler.running
            and engine.num_free_pages == engine.config.num_pages - 1)


def _check_the_rest(engine: Engine, final, expected, failed: str, error: str) -> None:
    """The failed request ended with "error" (its output names the kind of `error`); the
    others got their tokens; all is freed."""
    assert final[failed].error is not None and error in final[failed].error
    assert {sample.finish_reason for sample in final[failed].outputs} == {"error"}
    for request_id, tokens in expected.items():
        if request_id != failed:
            assert final[request_id].outputs[0].token_ids == tokens, request_id
            assert final[request_id].outputs[0].finish_reason == "length"
            assert final[request_id].error is None
    assert _idle(engine)
    # The engine keeps serving: the failed prompt now runs to its reference tokens.
    engine.add_request("again", PROMPTS[failed], _greedy())
    again = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            again = output
    assert again.outputs[0].token_ids == expected[failed] and again.error is None
    assert _idle(engine)


@pytest.mark.parametrize("after_tokens", [0, 3], ids=["prefill", "decode"])
def test_a_request_whose_inputs_cannot_be_packed_fails_alone(model, expected, monkeypatch,
                                                             after_tokens):
    bad = _greedy()
    real = runner_module.build_sampling_arrays

    def failing(params, vocab_size, **kwargs):
        for row, row_params in enumerate(params):
            if row_params is bad and len(kwargs["output_token_ids"][row]) >= after_tokens:
                raise OverflowError("bad row")
        return real(params, vocab_size, **kwargs)

    monkeypatch.setattr(runner_module, "build_sampling_arrays", failing)
    engine = _engine(model)
    final = _run(engine, {"b": bad})
    assert len(final["b"].outputs[0].token_ids) == after_tokens
    _check_the_rest(engine, final, expected, "b", "OverflowError")


@pytest.mark.parametrize("n", [1, 3])
def test_a_request_whose_output_processing_fails_fails_alone(model, expected, monkeypatch, n):
    engine = _engine(model)
    real = SampleState.add
    broken: list[SampleState] = []

    def failing(self, new_token_ids, *args, **kwargs):
        if self in broken and len(self.token_ids) >= 2:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad row")
        return real(self, new_token_ids, *args, **kwargs)

    monkeypatch.setattr(SampleState, "add", failing)
    original_add = engine.add_request

    def add(request_id, prompt, params=None, **kwargs):
        original_add(request_id, prompt, params, **kwargs)
        if request_id == "c":
            broken.append(engine.output_processor._requests["c"].samples[0])

    engine.add_request = add
    final = _run(engine, {"c": _greedy(n)})
    assert len(final["c"].outputs) == n  # sample 1.. of n > 1 never ran (deferred) or ended
    assert final["c"].outputs[0].token_ids == expected["c"][:2]
    _check_the_rest(engine, final, expected, "c", "UnicodeDecodeError")


def test_a_failing_device_step_still_raises(model, monkeypatch):
    engine = _engine(model)

    def broken(*_):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "run", broken)
    engine.add_request("a", PROMPTS["a"], _greedy())
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
