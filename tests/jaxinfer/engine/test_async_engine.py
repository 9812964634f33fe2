"""AsyncEngine: concurrent asyncio streams over the background engine thread, equal to the
synchronous engine; aborts, disconnects and bad requests leave the others running.

Tests of what happens while a step is in progress hold the engine thread inside `step()`: a
real engine is wrapped so its step waits at a gate the test opens.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from jaxinfer.config import get_preset
from jaxinfer.engine.async_engine import AsyncEngine, EngineDeadError
from jaxinfer.engine.core import Engine, EngineConfig
from jaxinfer.engine.sampling_params import RequestOutputKind, SamplingParams
from jaxinfer.generate import generate
from jaxinfer.models import create_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[1, 5, 9, 200], [1, 300, 301, 302, 303, 304, 305], [1, 42], [1, 7, 7, 7, 7, 7]]


@pytest.fixture(scope="module")
def model():
    return create_model(get_preset("tiny"), seed=0)


def _engine(model) -> Engine:
    return Engine(model, EngineConfig.from_options(
        page_size=4, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64,
        enable_prompt_logprobs=False))


class _GatedEngine:
    """A real engine whose `step` can be held, before it starts, until the test releases it.

    Everything but `step` is the engine's own (attribute access is delegated).
    """

    def __init__(self, engine: Engine) -> None:
        self.inner = engine
        self._condition = threading.Condition()
        self._closed = False
        self._held = False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def step(self):
        with self._condition:
            self._held = self._closed
            self._condition.notify_all()
            self._condition.wait_for(lambda: not self._closed)
            self._held = False
        return self.inner.step()

    def hold(self) -> None:
        """Makes the next step wait at the gate until `release()`."""
        with self._condition:
            self._closed = True

    def wait_until_held(self, timeout: float = 60.0) -> None:
        """Returns once the engine thread waits inside `step()`."""
        with self._condition:
            assert self._condition.wait_for(lambda: self._held, timeout)

    def release(self) -> None:
        with self._condition:
            self._closed = False
            self._condition.notify_all()


@pytest.fixture
def engine(model):
    engine = AsyncEngine(_engine(model), warm_up=False)
    engine.start()
    yield engine
    engine.shutdown()


@pytest.fixture
def gated(model):
    """An AsyncEngine over a `_GatedEngine`, and that gated engine."""
    inner = _GatedEngine(_engine(model))
    engine = AsyncEngine(inner, warm_up=False)
    engine.start()
    yield engine, inner
    inner.release()  # a failed test must not leave the thread held: shutdown joins it
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


async def _hold_a_step(engine, inner, request_id="running"):
    """Starts a request and holds the engine thread inside its first step.

    Returns:
        The request's stream, and a task for its first output (done once the step is released).
    """
    inner.hold()
    stream = engine.generate(PROMPTS[0], GREEDY, request_id)
    first = asyncio.ensure_future(stream.__anext__())
    await asyncio.to_thread(inner.wait_until_held)
    return stream, first


async def _rest(stream, first):
    return [await first, *[output async for output in stream]]


def test_abort_during_a_step_frees_its_pages_and_others_finish(gated, model):
    engine, inner = gated
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    async def main():
        victim = engine.generate(PROMPTS[0], long, "victim")
        outputs = [await victim.__anext__()]
        others = [asyncio.create_task(_collect(engine, prompt)) for prompt in PROMPTS[2:]]
        inner.hold()
        await asyncio.to_thread(inner.wait_until_held)
        abort = asyncio.create_task(engine.abort("victim"))
        await asyncio.sleep(0.05)
        assert not abort.done()  # queued: it applies when the step ends
        inner.release()
        assert await abort
        outputs.extend([output async for output in victim])
        return outputs, await asyncio.gather(*others)

    outputs, others = asyncio.run(main())
    last = outputs[-1].outputs[0]
    assert outputs[-1].finished and last.finish_reason == "abort" and len(last.token_ids) < 40
    lengths = [len(output.outputs[0].token_ids) for output in outputs]
    assert lengths == sorted(lengths)  # the held step's output came before the abort's
    expected = generate(model, PROMPTS[2:], max_new_tokens=6, eos_token_ids=())
    assert [result[-1].outputs[0].token_ids for result in others] == expected
    assert _idle(engine) and engine.is_running  # the victim's pages are back in the pool


def test_stats_and_generate_do_not_wait_for_a_step(gated, model):
    engine, inner = gated

    async def main():
        running, first = await _hold_a_step(engine, inner)
        start = time.perf_counter()
        stats = engine.stats()
        elapsed = time.perf_counter() - start
        # A new request's generate returns its iterator and queues the add at once; the add
        # itself (and so the first output) waits for the held step.
        new = asyncio.create_task(_collect(engine, PROMPTS[2], request_id="new"))
        await asyncio.sleep(0.05)
        pending = not new.done() and engine.num_unfinished_requests == 1
        unchanged = engine.stats() is stats  # nothing is published inside a step
        inner.release()
        return elapsed, stats, pending, unchanged, await new, await _rest(running, first)

    elapsed, stats, pending, unchanged, new, running = asyncio.run(main())
    assert elapsed < 0.01, f"stats() took {elapsed * 1000:.1f} ms during a step"
    # The state the step started from: the request admitted but not yet scheduled.
    assert (stats.num_steps, stats.num_running, stats.num_waiting) == (0, 0, 1)
    assert pending and unchanged
    expected = generate(model, [PROMPTS[0], PROMPTS[2]], max_new_tokens=6, eos_token_ids=())
    assert [running[-1].outputs[0].token_ids, new[-1].outputs[0].token_ids] == expected
    after = engine.stats()
    assert after.num_steps > stats.num_steps and (after.num_running, after.num_waiting) == (0, 0)
    assert _idle(engine)


def test_an_invalid_request_raises_before_yielding_and_others_carry_on(engine, model):
    long = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)

    async def main():
        kept = engine.generate(PROMPTS[0], long, "kept")
        outputs = [await kept.__anext__()]
        for prompt, request_id, match in (([1, 10**6], "bad", "outside the vocabulary"),
                                          ([], "empty", "at least one token"),
                                          (PROMPTS[1], "kept", "already in use")):
            with pytest.raises(ValueError, match=match):
                await engine.generate(prompt, GREEDY, request_id).__anext__()
            assert engine.num_unfinished_requests == 1  # nothing was queued
        outputs.extend([output async for output in kept])
        # The refused request's id was never taken.
        return outputs, await _collect(engine, PROMPTS[2], request_id="bad")

    outputs, reused = asyncio.run(main())
    # The refused duplicate neither aborted nor disturbed the request that holds its id.
    assert outputs[-1].outputs[0].finish_reason == "length"
    [expected] = generate(model, [PROMPTS[0]], max_new_tokens=30, eos_token_ids=())
    assert outputs[-1].outputs[0].token_ids == expected
    assert reused[-1].outputs[0].token_ids == generate(
        model, [PROMPTS[2]], max_new_tokens=6, eos_token_ids=())[0]
    assert _idle(engine)


def test_commands_apply_in_the_order_issued(gated, model):
    engine, inner = gated

    async def main():
        running, first = await _hold_a_step(engine, inner)
        # All four commands wait in the queue while the step is held.
        added = asyncio.create_task(_collect(engine, PROMPTS[1], request_id="x"))
        await asyncio.sleep(0)  # its add is queued
        abort_after_add = asyncio.create_task(engine.abort("x"))
        abort_before_add = asyncio.create_task(engine.abort("y"))
        await asyncio.sleep(0)
        added_later = asyncio.create_task(_collect(engine, PROMPTS[2], request_id="y"))
        await asyncio.sleep(0.05)
        tasks = (added, abort_after_add, abort_before_add, added_later)
        none_done = not any(task.done() for task in tasks)
        inner.release()
        await _rest(running, first)
        return none_done, await asyncio.gather(*tasks)

    none_done, (x, x_aborted, y_aborted, y) = asyncio.run(main())
    assert none_done
    assert x_aborted and [output.outputs[0].finish_reason for output in x] == ["abort"]
    assert x[-1].finished and x[-1].outputs[0].token_ids == []  # aborted before any step
    assert not y_aborted  # it came before y's add: nothing to abort
    assert y[-1].outputs[0].token_ids == generate(
        model, [PROMPTS[2]], max_new_tokens=6, eos_token_ids=())[0]
    assert _idle(engine)


def test_a_generate_cancelled_while_its_add_waits_leaves_nothing(gated):
    engine, inner = gated

    async def main():
        running, first = await _hold_a_step(engine, inner)
        waiting = asyncio.create_task(_collect(engine, PROMPTS[1], request_id="gone"))
        await asyncio.sleep(0.05)
        waiting.cancel()
        inner.release()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        return await _rest(running, first)

    assert asyncio.run(main())[-1].finished
    assert _idle(engine)
    assert asyncio.run(engine.abort("gone")) is False


def test_an_idle_engine_wakes_at_once(model):
    engine = AsyncEngine(_engine(model), warm_up=False, idle_wait_seconds=60.0)
    engine.start()
    time.sleep(0.1)  # the thread now blocks on its empty command queue
    start = time.perf_counter()
    assert asyncio.run(engine.abort("nobody")) is False
    engine.shutdown()
    assert time.perf_counter() - start < 5.0  # far below the 60 s idle wait, twice over


def test_shutdown_ends_open_streams(model):
    engine = AsyncEngine(_engine(model), warm_up=False)
    engine.start()
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    async def main():
        stream = engine.generate(PROMPTS[0], long, "open")
        await stream.__anext__()
        await asyncio.to_thread(engine.shutdown)
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError, match="not running"):
            await _collect(engine, PROMPTS[1])
        return await engine.abort("open")

    assert asyncio.run(main()) is False
    assert not engine.is_running and not engine.errored and _idle(engine)


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_a_consumer_that_falls_behind_gets_what_it_missed_in_one_item(engine, model, kind):
    max_tokens = 30
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            output_kind=kind)

    async def main():
        paused = engine.generate(PROMPTS[0], params, "paused")
        first = await paused.__anext__()
        stream = engine._streams["paused"]
        # This consumer reads nothing while the engine runs the request to its end.
        while stream.pending is None or not stream.pending.finished:
            await asyncio.sleep(0.01)
        held = stream.pending
        rest = [output async for output in paused]
        return first, stream, held, rest

    first, stream, held, rest = asyncio.run(main())
    # One unread item, whatever the number of steps it missed: each step's output (one
    # token each) was merged into it rather than queued behind it.
    assert len(rest) == 1 and rest[0] is held and rest[0].finished
    assert 1 + len(rest) + stream.num_merged == max_tokens
    expected = generate(model, [PROMPTS[0]], max_new_tokens=max_tokens, eos_token_ids=())[0]
    if kind is RequestOutputKind.DELTA:  # the missed deltas, concatenated
        assert first.outputs[0].token_ids + rest[0].outputs[0].token_ids == expected
    else:  # the newest cumulative output replaced the older ones
        assert rest[0].outputs[0].token_ids == expected
    assert _idle(engine)
