"""Reference generation: stopping, seeding, validation, batch independence."""

from __future__ import annotations

import pytest

from jaxinfer.config import get_preset
from jaxinfer.generate import SamplingConfig, generate
from jaxinfer.models import create_model


@pytest.fixture(scope="module")
def model():
    return create_model(get_preset("tiny").replace(max_position_embeddings=128), seed=4)


def test_batched_greedy_equals_one_at_a_time(model):
    prompts = [[1, 5, 9], [1, 7, 3, 22, 91, 4, 8, 15, 16, 23, 42], [1]]
    batched = generate(model, prompts, max_new_tokens=10, eos_token_ids=())
    singles = [generate(model, [prompt], max_new_tokens=10, eos_token_ids=())[0]
               for prompt in prompts]
    assert batched == singles
    assert all(len(out) == 10 for out in batched)


def test_stops_at_eos_and_includes_it(model):
    prompt = [1, 5, 9]
    free = generate(model, [prompt], max_new_tokens=12, eos_token_ids=())[0]
    stop = free[4]
    stopped = generate(model, [prompt], max_new_tokens=12, eos_token_ids=(stop,))[0]
    assert stopped == free[: free.index(stop) + 1]


def test_seeded_sampling_is_reproducible_and_seed_dependent(model):
    prompt = [[1, 2, 3, 4]]
    sampling = SamplingConfig(temperature=1.0, top_k=50, top_p=0.95, seed=3)
    first = generate(model, prompt, max_new_tokens=16, sampling=sampling, eos_token_ids=())
    again = generate(model, prompt, max_new_tokens=16, sampling=sampling, eos_token_ids=())
    other = generate(model, prompt, max_new_tokens=16, eos_token_ids=(),
                     sampling=SamplingConfig(temperature=1.0, top_k=50, top_p=0.95, seed=4))
    assert first == again
    assert first != other


def test_invalid_requests_are_rejected_with_reasons(model):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model, [[1], []], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"token ids \[9999\] outside the vocabulary"):
        generate(model, [[1, 9999]], max_new_tokens=2)
    with pytest.raises(ValueError, match="exceed max_position_embeddings = 128"):
        generate(model, [[1] * 100], max_new_tokens=40)
    with pytest.raises(ValueError, match="top_p = 0"):
        SamplingConfig(top_p=0)
    with pytest.raises(ValueError, match="temperature = -1"):
        SamplingConfig(temperature=-1)
