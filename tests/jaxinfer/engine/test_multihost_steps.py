"""The leader's side of a multi-host engine: a failing engine step ends the followers too.

A real engine leads a real step channel over a socket pair; the follower's end runs on a
thread here, with `multihost.fatal` recording the exit it would make instead of making it.
"""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from jaxinfer import multihost
from jaxinfer.config import get_preset
from jaxinfer.engine.async_engine import AsyncEngine, EngineDeadError
from jaxinfer.engine.core import Engine, EngineConfig
from jaxinfer.engine.multihost_steps import LeaderEngine
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.models import create_model
from jaxinfer.multihost import EXIT_PEER_LOST, StepChannel


class _ExitError(Exception):
    """Where the follower would have exited: (message, status)."""


@pytest.fixture
def channels(monkeypatch):
    """(leader, follower) ends of one step channel, the follower process 1."""
    def fatal(message, code=EXIT_PEER_LOST):
        raise _ExitError(message, code)

    monkeypatch.setattr(multihost, "fatal", fatal)
    leader_socket, follower_socket = socket.socketpair()
    leader = StepChannel(leader=True, sockets={1: leader_socket})
    follower = StepChannel(leader=False, sockets={0: follower_socket})
    yield leader, follower
    leader.abort("test over")
    follower_socket.close()


def _follow(follower: StepChannel
            ) -> tuple[threading.Thread, list[str], list[_ExitError]]:
    """Starts receiving on a thread; returns it, and the kinds received and the exits it
    would have made, filled as it goes."""
    kinds: list[str] = []
    exits: list[_ExitError] = []

    def run():
        try:
            while True:
                kinds.append(follower.receive()[0])
        except _ExitError as error:
            exits.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, kinds, exits


def test_a_failing_leader_step_aborts_the_followers(channels):
    leader, follower = channels
    engine = Engine(create_model(get_preset("tiny"), seed=0), EngineConfig.from_options(
        page_size=4, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64,
        enable_prompt_logprobs=False), step_channel=leader)
    thread, received, exits = _follow(follower)
    async_engine = AsyncEngine(LeaderEngine(engine, leader), warm_up=False)

    async def serve():
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        async for _ in async_engine.generate([1, 5, 9], params):
            pass
        def broken(kind, inputs):  # the device step fails after the step went out
            raise RuntimeError("device lost")

        engine.runner.run = broken
        with pytest.raises(EngineDeadError, match="device lost"):
            async for _ in async_engine.generate([1, 7], params):
                pass

    async_engine.start()
    try:
        asyncio.run(serve())
    finally:
        async_engine.shutdown()
    thread.join(timeout=60)  # a guard: without the abort the follower waits for ever
    assert not thread.is_alive(), "the follower still waits for the leader's steps"
    assert len(received) >= 3  # the first request's steps and the failed one's
    ((message, code),) = [error.args for error in exits]
    assert code == EXIT_PEER_LOST != 0
    assert message == ("the leader aborted the run: the leader's engine step failed: "
                       "RuntimeError('device lost')")


def test_a_leader_engine_needs_the_leaders_end(channels):
    _, follower = channels
    with pytest.raises(ValueError, match="leader's end"):
        LeaderEngine(object(), follower)
