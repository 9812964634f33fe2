"""AsyncEngine: concurrent asyncio streams over the background engine thread, equal to the
synchronous engine; aborts, disconnects and bad requests leave the others running."""

from __future__ import annotations

import asyncio

import pytest

from jaxinfer.config import get_preset
from jaxinfer.engine.async_engine import AsyncEngine, EngineDeadError
from jaxinfer.engine.core import Engine, EngineConfig
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.generate import generate
from jaxinfer.models import create_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[1, 5, 9, 200], [1, 300, 301, 302, 303, 304, 305], [1, 42], [1, 7, 7, 7, 7, 7]]


@pytest.fixture(scope="module")
def model():
    return create_model(get_preset("tiny"), seed=0)


@pytest.fixture
def engine(model):
    engine = AsyncEngine(Engine(model, EngineConfig.from_options(
        page_size=4, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64,
        enable_prompt_logprobs=False)), warm_up=False)
    engine.start()
    yield engine
    engine.shutdown()


async def _collect(engine, prompt, params=GREEDY, request_id=None):
    outputs = [output async for output in engine.generate(prompt, params, request_id)]
    return outputs


def _idle(engine):
    inner = engine.engine
    return (not inner.has_unfinished_requests() and engine.num_unfinished_requests == 0
            and inner.num_free_pages == inner.config.num_pages - 1)


def test_concurrent_streams_equal_reference(engine, model):
    async def main():
        return await asyncio.gather(*(_collect(engine, prompt) for prompt in PROMPTS))

    results = asyncio.run(main())
    expected = generate(model, PROMPTS, max_new_tokens=6, eos_token_ids=())
    for outputs, tokens in zip(results, expected, strict=True):
        assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == tokens
        lengths = [len(output.outputs[0].token_ids) for output in outputs]
        assert lengths == sorted(lengths)  # cumulative outputs only grow
    assert _idle(engine)


def test_abort_disconnect_and_bad_request_leave_others_running(engine, model):
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    async def aborted():
        outputs = []
        async for output in engine.generate(PROMPTS[0], long, "to-abort"):
            outputs.append(output)
            # The abort's own final output may also hold 2 tokens; abort only once.
            if len(output.outputs[0].token_ids) == 2 and not output.finished:
                assert await engine.abort("to-abort")
        return outputs

    async def disconnected():
        async for output in engine.generate(PROMPTS[1], long, "to-leave"):
            if len(output.outputs[0].token_ids) >= 3:
                break  # the client went away
        return "left"

    async def bad():
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await _collect(engine, [1, 10**6])
        return "rejected"

    async def main():
        return await asyncio.gather(aborted(), disconnected(), bad(),
                                    _collect(engine, PROMPTS[2]), _collect(engine, PROMPTS[3]))

    aborted_outputs, left, rejected, third, fourth = asyncio.run(main())
    assert aborted_outputs[-1].outputs[0].finish_reason == "abort"
    assert len(aborted_outputs[-1].outputs[0].token_ids) < 40
    assert (left, rejected) == ("left", "rejected")
    expected = generate(model, PROMPTS[2:], max_new_tokens=6, eos_token_ids=())
    assert [third[-1].outputs[0].token_ids, fourth[-1].outputs[0].token_ids] == expected
    assert _idle(engine) and engine.is_running


def test_duplicate_ids_and_a_failing_step(engine):
    async def main():
        first = engine.generate(PROMPTS[0], SamplingParams(max_tokens=30, ignore_eos=True),
                                "same")
        await first.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            await _collect(engine, PROMPTS[1], request_id="same")

        def broken(*_):
            raise RuntimeError("device lost")

        engine.engine.runner.execute = broken  # the device step fails from now on
        with pytest.raises(EngineDeadError, match="device lost"):
            async for _ in first:
                pass
        with pytest.raises(EngineDeadError, match="not running"):
            await _collect(engine, PROMPTS[1])

    asyncio.run(main())
    assert engine.errored and not engine.is_running
