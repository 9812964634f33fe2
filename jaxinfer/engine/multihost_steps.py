"""An engine on several processes: process 0 schedules, every process runs the steps.

In a multi-host run (`jaxinfer.distributed`), each process loads the same engine onto the
same global meshes (`jaxinfer.engine.parallel` gives every replica a share of every process's
devices). Process 0, the leader, owns the front ends and the scheduler: `lead` makes each of
its runners send every step's packed host inputs, tagged with the replica index, down a
`jaxinfer.multihost.StepChannel` before running it. Every other process calls `follow`, which
runs the same steps on the same inputs in the same order, until the leader closes the channel.
Because warm-up is a sequence of steps too, followers compile what the leader compiles.

Failure handling is the channel's: a process that dies ends the others at once with
`jaxinfer.multihost.EXIT_PEER_LOST`, and jax's own heartbeat covers a host that vanishes.
"""

from __future__ import annotations

import logging

from jaxinfer.engine.client import EngineClient
from jaxinfer.engine.device.runner import ModelRunner
from jaxinfer.multihost import StepChannel

logger = logging.getLogger(__name__)


def runners_of(engine: EngineClient) -> list[ModelRunner]:
    """The engine's runners, one per data-parallel replica, in replica order."""
    return engine.runners


def lead(engine: EngineClient, channel: StepChannel) -> None:
    """Makes the leader's runners send each step to the followers before running it.

    Raises:
        ValueError: `channel` is a follower's end, or the engine drafts with a separate
            model (its steps run on process 0's devices only, which multi-host serving does
            not support yet).
    """
    if not channel.is_leader:
        raise ValueError("lead() takes the leader's end of the step channel (process 0)")
    speculative = engine.config.speculative
    if speculative is not None and speculative.method == "draft_model":
        raise ValueError("speculative decoding with a draft model is not supported across "
                         "several processes yet; use the ngram method")
    for index, runner in enumerate(runners_of(engine)):
        runner.channel, runner.channel_tag = channel, index


def follow(engine: EngineClient, channel: StepChannel) -> int:
    """Runs the leader's steps on this process until the leader closes the channel.

    Returns:
        How many steps this process ran.

    Raises:
        ValueError: A message for a replica or step kind this engine does not have (the
            processes were started with different options).
    """
    runners = runners_of(engine)
    count = 0
    for kind, (tag, packed) in channel:
        if not 0 <= tag < len(runners):
            raise ValueError(f"the leader sent a step for replica {tag}, but this process "
                             f"has {len(runners)}: start every process with the same options")
        runners[tag].run_packed(kind, packed)
        count += 1
    logger.info("the leader closed the step channel after %d steps", count)
    return count
