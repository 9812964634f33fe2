"""Typed step inputs and outputs: `prepare` pads to the buckets, the inputs survive the step
channel's encoding, and a follower that runs what a leading runner sent ends in the same
state."""

from __future__ import annotations

import types

import jax
import numpy as np
import pytest

from jaxinfer.config import get_preset
from jaxinfer.engine import multihost_steps
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.core import Engine
from jaxinfer.engine.device.runner import ModelRunner, RunnerConfig
from jaxinfer.engine.device.step_io import PROMPT_STEP, STEP, StepInputs, StepOutputs
from jaxinfer.engine.host.scheduler import ScheduledRequest
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.models import create_model
from jaxinfer.multihost import decode, encode


@pytest.fixture(scope="module")
def model():
    return create_model(get_preset("tiny"), seed=0)


def _runner(model, channel=None, **overrides):
    config = dict(num_pages=20, page_size=4, max_num_batched_tokens=16, max_num_seqs=4,
                  max_model_len=32)
    return ModelRunner(model, RunnerConfig(**{**config, **overrides}), channel=channel)


def _prefill(request_id, tokens, table, params=None):
    return ScheduledRequest(request_id, list(tokens), list(range(len(tokens))), table, True,
                            0, params, tuple(tokens), [])


class _RecordingChannel:
    """The leader's end of a step channel, keeping what was sent."""

    is_leader = True

    def __init__(self):
        self.messages = []

    def send(self, kind, payload):
        # Through the real wire format, as a follower would receive it.
        self.messages.append(decode(*_split(encode(len(self.messages), kind, payload))))


def _split(frame):
    """encode's frame -> decode's (pickled bytes, buffers)."""
    _header, pickled, *buffers = frame
    return bytes(pickled), [bytearray(buffer) for buffer in buffers]


def test_prepare_pads_to_the_buckets(model):
    runner = _runner(model, num_speculative_tokens=2)
    inputs = runner.prepare([_prefill("a", [1, 2, 3, 4, 5], [1, 2]),
                             _prefill("b", [7, 8], [3])])
    assert isinstance(inputs, StepInputs)
    assert inputs.token_ids.shape == (8,) and inputs.positions.shape == (8,)  # T = 8
    # Q = min(T, max_num_seqs) = 4 rows; the two padding rows point at token 0.
    assert inputs.last_token_index.tolist() == [4, 6, 0, 0]
    assert inputs.draft_token_ids.shape == (4, 2) and inputs.draft_probs is None
    assert inputs.batch.page_indices.shape == (4, runner.config.pages_per_sequence)
    with pytest.raises(ValueError, match="at least one"):
        runner.prepare([])


def test_outputs_leave_absent_fields_none(model):
    runner = _runner(model)
    scheduled = [_prefill("a", [1, 2, 3], [1])]
    outputs = runner.run(runner.step_kind(scheduled), runner.prepare(scheduled))
    assert isinstance(outputs, StepOutputs)
    # T = 8, so Q = min(8, max_num_seqs = 4) rows.
    assert outputs.tokens.shape == (4,) and outputs.top_ids.shape == (4, runner.config.max_logprobs)
    assert outputs.probabilities is None and outputs.prompt_logprobs is None
    assert outputs.spec_tokens is None and outputs.num_accepted is None
    prompt = [_prefill("a", [1, 2, 3], [1], SamplingParams(prompt_logprobs=1))]
    assert runner.step_kind(prompt) == PROMPT_STEP
    assert runner.run(PROMPT_STEP, runner.prepare(prompt)).prompt_logprobs.shape == (8,)


def test_inputs_survive_the_step_channel(model):
    runner = _runner(model)
    inputs = runner.prepare([_prefill("a", [1, 2, 3], [1], SamplingParams(temperature=0.7))])
    kind, (tag, received) = decode(*_split(encode(1, STEP, (3, inputs))))
    assert (kind, tag) == (STEP, 3) and type(received) is StepInputs
    assert type(received.batch) is type(inputs.batch)
    assert type(received.sampling) is type(inputs.sampling)
    jax.tree.map(np.testing.assert_array_equal, received, inputs)


def test_a_follower_running_the_leaders_steps_ends_in_the_same_state(model):
    channel = _RecordingChannel()
    leader, follower = _runner(model, channel=channel), _runner(model)
    leader.execute([_prefill("a", [1, 2, 3, 4, 5], [1, 2]), _prefill("b", [9, 8], [3])])
    leader.execute([ScheduledRequest("a", [6], [5], [1, 2], True, 0, None, (1, 2, 3, 4, 5))])
    follower_engine = types.SimpleNamespace(runners=[follower])
    assert multihost_steps.follow(follower_engine, iter(channel.messages)) == 2
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(follower.pages),
                 jax.device_get(leader.pages))


def test_a_runner_refuses_a_followers_end(model):
    follower_end = types.SimpleNamespace(is_leader=False)
    with pytest.raises(ValueError, match="leader"):
        _runner(model, channel=follower_end)


def test_an_engine_with_a_step_channel_refuses_a_draft_model(model):
    config = EngineConfig.from_options(
        page_size=4, max_num_batched_tokens=16, max_num_seqs=2, max_model_len=32,
        speculative={"method": "draft_model", "model": "random:tiny", "num_tokens": 2})
    with pytest.raises(ValueError, match="draft model"):
        Engine(model, config, step_channel=_RecordingChannel())
