"""The device step: chunked prefill and batched decode equal reference generation; no
compilation after warm-up; seeded sampling does not depend on the rest of the batch; logprobs
and prompt logprobs equal the log-softmax of a full forward pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import get_preset
from jaxinfer.engine.device.runner import ModelRunner, RunnerConfig, power_of_two_buckets
from jaxinfer.engine.host.scheduler import ScheduledRequest
from jaxinfer.engine.sampling_params import SamplingParams
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


def _scheduled(request_id, tokens, start, table, needs_sample=True, outputs=0, sampling=None,
               prompt=(), output_ids=()):
    return ScheduledRequest(request_id, list(tokens), list(range(start, start + len(tokens))),
                            table, needs_sample, outputs, sampling, tuple(prompt),
                            list(output_ids))


def _drive(runner, prompts, new_tokens, chunk, sampling=None, on_step=lambda *_: None):
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
                                   sampling, prompt, list(outputs[i])))
        for sequence in step:
            done[int(sequence.request_id)] += len(sequence.token_ids)
        result = runner.execute(step)
        for sequence in step:
            if sequence.needs_sample:
                outputs[int(sequence.request_id)].append(
                    result.sampled[sequence.request_id].token_id)
            on_step(sequence, result)
    return outputs


def test_chunked_prefill_and_decode_equal_reference_generation(model):
    prompts = [[1, 5, 9, 200, 7, 7, 31, 64, 2, 90, 11], [1, 300], [1, 42, 43, 44, 45, 46]]
    expected = generate(model, prompts, max_new_tokens=8, eos_token_ids=())
    runner = _runner(model)
    assert _drive(runner, prompts, 8, chunk=5) == expected


def test_one_program_per_token_bucket_and_no_compilation_after_warm_up(model):
    runner = _runner(model)
    seconds = runner.warm_up()
    compiled = runner.compilations
    assert seconds > 0 and compiled == len(runner.config.token_buckets)
    _drive(runner, [[1, 2, 3, 4, 5, 6, 7], [1, 9]], 5, chunk=3)
    _drive(runner, [[1] * 20, [1, 5], [1, 6], [1, 7]], 3, chunk=32,
           sampling=SamplingParams(temperature=0.7, logprobs=3, presence_penalty=0.5,
                                   logit_bias={4: 1.0}, min_tokens=2))
    assert runner.compilations == compiled


def test_prompt_logprobs_compile_their_program_once_per_bucket(model):
    runner = _runner(model)
    runner.warm_up()
    compiled = runner.compilations
    sampling = SamplingParams(prompt_logprobs=2)
    _drive(runner, [[1] * 20, [1, 5]], 2, chunk=32, sampling=sampling)
    first = runner.compilations
    assert first > compiled
    _drive(runner, [[1] * 20, [1, 5]], 2, chunk=32, sampling=sampling)
    assert runner.compilations == first


def test_prompt_logprobs_off_refuses_them(model):
    runner = _runner(model, enable_prompt_logprobs=False)
    runner.warm_up()
    assert runner.compilations == len(runner.config.token_buckets)
    with pytest.raises(ValueError, match="enable_prompt_logprobs=False"):
        _drive(runner, [[1, 2, 3]], 1, chunk=8, sampling=SamplingParams(prompt_logprobs=1))


def test_logprobs_and_prompt_logprobs_equal_a_full_forward(model):
    prompts = [[1, 5, 9, 200, 7, 7, 31, 64, 2, 90, 11], [1, 300, 301]]
    sampling = SamplingParams(temperature=0.0, logprobs=5, prompt_logprobs=4)
    seen = {}

    def record(sequence, result):
        seen.setdefault(sequence.request_id, []).append(
            (sequence, result.sampled.get(sequence.request_id),
             result.prompt_logprobs.get(sequence.request_id)))

    outputs = _drive(_runner(model), prompts, 3, chunk=4, sampling=sampling, on_step=record)
    for index, prompt in enumerate(prompts):
        full = prompt + outputs[index]
        logits, _ = model(jnp.asarray([full]))  # [1, L, V]
        logprobs = np.asarray(jax.nn.log_softmax(logits[0], axis=-1))  # [L, V]
        prompt_rows = {}
        for sequence, sampled, chunk in seen[str(index)]:
            if sampled is not None:
                position = sequence.positions[-1]
                np.testing.assert_allclose(sampled.logprob,
                                           logprobs[position, sampled.token_id], atol=1e-5)
                order = np.argsort(-logprobs[position], kind="stable")[:5]
                np.testing.assert_array_equal(sampled.top_token_ids[:5], order)
                np.testing.assert_allclose(sampled.top_logprobs[:5],
                                           logprobs[position, order], atol=1e-5)
            if chunk is not None:
                for row, value in enumerate(chunk.logprobs):
                    prompt_rows[chunk.first_position + row] = (value, chunk.top_token_ids[row])
        # Every prompt token but the first, each predicted from the position before it.
        assert sorted(prompt_rows) == list(range(1, len(prompt)))
        for position, (value, top_ids) in prompt_rows.items():
            np.testing.assert_allclose(value, logprobs[position - 1, prompt[position]],
                                       atol=1e-5)
            assert top_ids[0] == np.argmax(logprobs[position - 1])


def test_seeded_sampling_is_batch_invariant(model):
    sampling = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=1234)
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
    assert power_of_two_buckets(1, 64, growth=4) == (1, 4, 16, 64)
    with pytest.raises(ValueError, match="bucket_growth = 1"):
        RunnerConfig(num_pages=8, page_size=4, max_num_batched_tokens=32, max_num_seqs=4,
                     max_model_len=64, bucket_growth=1)
