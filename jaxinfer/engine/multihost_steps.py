"""An engine on several processes: process 0 schedules, every process runs the steps.

In a multi-host run (`jaxinfer.distributed`), each process loads the same engine onto the
same global meshes (`jaxinfer.engine.parallel` gives every replica a share of every process's
devices). Process 0, the leader, owns the front ends and the scheduler: its engine is built with the
leader's end of a `jaxinfer.multihost.StepChannel` (`load_engine(..., step_channel=...)`), so
each of its runners sends every step's kind and `StepInputs`, tagged with the replica index,
down the channel before running it. Every other process calls `follow`, which
runs the same steps on the same inputs in the same order, until the leader closes the channel.
Because warm-up is a sequence of steps too, followers compile what the leader compiles.

Failure handling is the channel's: a process that dies ends the others at once with
`jaxinfer.multihost.EXIT_PEER_LOST`, and jax's own heartbeat covers a host that vanishes.
One failure leaves every process alive: the leader's engine step raising inside a server's
engine thread, which marks the engine dead and answers 503 but lets no exception out to the
`with channel:` block, so the followers would wait for steps forever. The leader's engine is
therefore wrapped in `LeaderEngine`, which aborts the channel when a step (or the warm-up)
raises: every follower then exits with `EXIT_PEER_LOST` and the reason.
"""

from __future__ import annotations

import logging
from typing import Any

from jaxinfer.engine.client import EngineClient
from jaxinfer.engine.device.sampler import SamplingArrays
from jaxinfer.engine.device.step_io import StepInputs
from jaxinfer.engine.outputs import RequestOutput
from jaxinfer.models import PagedBatch
from jaxinfer.multihost import StepChannel, register_payload_types

logger = logging.getLogger(__name__)

# What a step message carries besides numpy arrays; registered by name on every process (the
# leader and the followers both import this module) rather than trusted because some module
# happens to be imported.
register_payload_types(StepInputs, PagedBatch, SamplingArrays)


def follow(engine: EngineClient, channel: StepChannel) -> int:
    """Runs the leader's steps on this process until the leader closes the channel.

    Returns:
        How many steps this process ran.

    Raises:
        ValueError: A message for a replica or step kind this engine does not have (the
            processes were started with different options).
    """
    runners = engine.runners
    count = 0
    for kind, (tag, inputs) in channel:
        if not 0 <= tag < len(runners):
            raise ValueError(f"the leader sent a step for replica {tag}, but this process "
                             f"has {len(runners)}: start every process with the same options")
        runners[tag].run(kind, inputs)
        count += 1
    logger.info("the leader closed the step channel after %d steps", count)
    return count


class LeaderEngine:
    """The leader's engine in a multi-host run: a failing step aborts the step channel.

    Wraps an engine built with the leader's end of `channel` (`load_engine(...,
    step_channel=channel)`); everything but `step` and `warm_up` is the engine's own.
    When either raises, the followers are told to exit with the error before it
    propagates (to `AsyncEngine`, which then marks the engine dead), since a dead leader
    engine sends no more steps and the followers would otherwise wait for them forever.
    """

    def __init__(self, engine: EngineClient, channel: StepChannel) -> None:
        if not channel.is_leader:
            raise ValueError("LeaderEngine takes the leader's end of the step channel")
        self.engine = engine
        self.channel = channel

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def step(self) -> list[RequestOutput]:
        """The engine's step; aborts the channel if it raises."""
        try:
            return self.engine.step()
        except Exception as error:
            self._abort("step", error)
            raise

    def warm_up(self) -> float:
        """The engine's warm-up (itself a sequence of steps); aborts the channel if it raises."""
        try:
            return self.engine.warm_up()
        except Exception as error:
            self._abort("warm-up", error)
            raise

    def _abort(self, what: str, error: Exception) -> None:
        logger.error("the leader's engine %s failed (%r); aborting the step channel so "
                     "every follower exits", what, error)
        try:
            self.channel.abort(f"the leader's engine {what} failed: {error!r}")
        except Exception:  # the step's error is the one to raise
            logger.exception("aborting the step channel failed")
