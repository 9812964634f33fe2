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
"""

from __future__ import annotations

import logging

from jaxinfer.engine.client import EngineClient
from jaxinfer.engine.device.sampler import SamplingArrays
from jaxinfer.engine.device.step_io import StepInputs
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
