"""The device step: chunked prefill and batched decode equal reference generation; no
compilation after warm-up; seeded sampling does not depend on the rest of the batch."""

from __future__ import annotations

import pytest

from jaxinfer.config import get_preset
from jaxinfer.engine.runner import ModelRunner, RunnerConfig, SequenceSampling, power_of_two_buckets
from jaxinfer.engine.scheduler import ScheduledRequest
from jaxinfer.generate import generate
from jaxinfer.models import create_model

PAGE_SIZE = 4


@pytest.fixture(scope="module")
def model():
    return create_model(get_preset("tiny"), seed=0)


def _runner(model, **overrides):
    config = dict(num_pages=40, page_size=PAGE_SIZE, max_num_batched_tokens=32,
                  max_num_seqs=4, max_model_len=64)
    return ModelRunner(model, RunnerConfig(**{**config, **overrides}))


def _scheduled(request_id, tokens, start, table, needs_sample=True, outputs=0, sampling=None):
    return ScheduledRequest(request_id, list(tokens), list(range(start, start + len(tokens))),
                            table, needs_sample, outputs, sampling)


def _drive(runner, prompts, new_tokens, chunk, sampling=None):
    """A hand-rolled schedule: prefill every prompt in `chunk`-token pieces, then decode."""
    tables = [list(range(1 + 10 * i, 11 + 10 * i)) for i in range(len(prompts))]
    done, outputs = [0] * len(prompts), [[] for _ in prompts]
    while any(len(out) < new_tokens for out in outputs):
        step = []
        for i, prompt in enumerate(prompts):
            if len(outputs[i]) >= new_tokens:
                continue
            known = prompt + outputs[i]
            piece = known[done[i]:done[i] + chunk]
            step.append(_scheduled(str(i), piece, done[i], tables[i],
                                   done[i] + len(piece) == len(known), len(outputs[i]),
                                   sampling))
        for sequence in step:
            done[int(sequence.request_id)] += len(sequence.token_ids)
        for request_id, token in runner.execute(step).items():
            outputs[int(request_id)].append(token)
    return outputs


def test_chunked_prefill_and_decode_equal_reference_generation(model):
    prompts = [[1, 5, 9, 200, 7, 7, 31, 64, 2, 90, 11], [1, 300], [1, 42, 43, 44, 45, 46]]
    expected = generate(model, prompts, max_new_tokens=8, eos_token_ids=())
    runner = _runner(model)
    assert _drive(runner, prompts, 8, chunk=5) == expected


def test_no_compilation_after_warm_up(model):
    runner = _runner(model)
    seconds = runner.warm_up()
    compiled = runner.compilations
    assert seconds > 0 and compiled == sum(
        1 for t in runner.config.token_buckets for s in runner.config.sequence_buckets
        if s <= t)
    _drive(runner, [[1, 2, 3, 4, 5, 6, 7], [1, 9]], 5, chunk=3)
    _drive(runner, [[1] * 20, [1, 5], [1, 6], [1, 7]], 3, chunk=32)
    assert runner.compilations == compiled


def test_seeded_sampling_is_batch_invariant(model):
    sampling = SequenceSampling(temperature=1.0, top_k=50, top_p=0.9, seed=1234)
    alone = _drive(_runner(model), [[1, 17, 18]], 6, chunk=8, sampling=sampling)
    crowded = _drive(_runner(model), [[1, 99, 98, 97], [1, 17, 18], [1, 5]], 6, chunk=8,
                     sampling=sampling)
    assert crowded[1] == alone[0]
    assert crowded[0] != crowded[1]  # the draws really are random


def test_bad_sizes_are_named(model):
    with pytest.raises(ValueError, match="max_num_seqs = 64 exceeds"):
        RunnerConfig(num_pages=8, page_size=4, max_num_batched_tokens=32, max_num_seqs=64,
                     max_model_len=64)
    runner = _runner(model)
    with pytest.raises(ValueError, match="do not fit"):
        runner.execute([_scheduled("x", [1, 2, 3, 4, 5], 0, [1])])
    assert power_of_two_buckets(8, 96) == (8, 16, 32, 64, 96)
