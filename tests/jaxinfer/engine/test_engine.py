"""The engine against reference generation: mixed lengths, random arrivals, tiny chunks,
preemption, prefix caching on and off, aborts; no leaked pages; no compilation after warm-up."""

from __future__ import annotations

import random

import pytest

from jaxinfer.config import get_preset
from jaxinfer.engine.core import Engine, EngineConfig
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.generate import generate
from jaxinfer.models import create_model

NEW_TOKENS = 4


@pytest.fixture(scope="module")
def model():
    return create_model(get_preset("tiny"), seed=0)


@pytest.fixture(scope="module")
def workload(model):
    """64 prompts of 1 to 500 tokens (some sharing prefixes) and their reference outputs."""
    rng = random.Random(0)
    shared = [rng.randrange(3, 512) for _ in range(100)]
    prompts = []
    for index in range(64):
        length = rng.choice([1, 2, 7, 33, 120, 260, 500]) if index % 4 else rng.randint(1, 500)
        prompt = [rng.randrange(3, 512) for _ in range(length)]
        if index % 5 == 0 and length > 100:
            prompt[:100] = shared  # a common system prompt
        prompts.append(prompt)
    expected = generate(model, prompts, max_new_tokens=NEW_TOKENS, eos_token_ids=())
    arrivals = sorted(rng.randrange(0, 60) for _ in prompts)
    return prompts, expected, arrivals


def _greedy(max_tokens):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _run(engine, prompts, arrivals, abort=()):
    outputs = {str(i): [] for i in range(len(prompts))}
    pending = list(range(len(prompts)))
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and arrivals[pending[0]] <= step:
            index = pending.pop(0)
            engine.add_request(str(index), prompts[index], _greedy(NEW_TOKENS))
        for request_id, at_step in abort:
            if at_step == step:
                engine.abort_request(request_id)
        for output in engine.step():
            outputs[output.request_id] = output.outputs[0].token_ids  # cumulative
        step += 1
    return [outputs[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("setting", [
    dict(enable_prefix_caching=True),
    dict(enable_prefix_caching=False),
    dict(enable_prefix_caching=True, num_pages=40),  # ~1.2 max-length sequences: preemption
], ids=["prefix-cache", "no-prefix-cache", "preemption"])
def test_engine_equals_reference_generation(model, workload, setting):
    prompts, expected, arrivals = workload
    config = EngineConfig.from_options(page_size=16, max_num_batched_tokens=48, max_num_seqs=8,
                          max_model_len=512, **setting)
    engine = Engine(model, config)
    assert _run(engine, prompts, arrivals) == expected
    assert engine.num_free_pages == engine.config.num_pages - 1  # nothing leaked
    if setting["enable_prefix_caching"] and "num_pages" not in setting:
        assert engine.prefix_cache_hit_rate > 0
    assert (engine.num_preemptions > 0) == ("num_pages" in setting)


def test_aborts_in_prefill_and_decode_free_everything(model, workload):
    prompts, expected, arrivals = workload
    engine = Engine(model, EngineConfig.from_options(page_size=16, max_num_batched_tokens=48,
                                        max_num_seqs=8, max_model_len=512))
    aborted = {"0": 3, "5": 40, "6": 41, "63": 200}  # some mid-prefill, some mid-decode
    got = _run(engine, prompts, arrivals, abort=aborted.items())
    for index, tokens in enumerate(got):
        if str(index) not in aborted:
            assert tokens == expected[index]
        else:
            assert tokens == expected[index][:len(tokens)]
    assert engine.num_free_pages == engine.config.num_pages - 1


def test_no_compilation_after_warm_up_and_batch_invariant_seeds(model):
    engine = Engine(model, EngineConfig.from_options(page_size=8, max_num_batched_tokens=32,
                                        max_num_seqs=4, max_model_len=128))
    engine.warm_up()
    compiled = engine.runner.compilations
    sampling = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=7, max_tokens=8,
                              ignore_eos=True)
    engine.add_request("alone", [1, 2, 3, 4, 5], sampling)
    alone = _collect(engine)["alone"]
    rng = random.Random(1)
    for index in range(12):
        prompt = [rng.randrange(3, 512) for _ in range(rng.randint(1, 90))]
        engine.add_request(f"other{index}", prompt, SamplingParams(
            temperature=1.0, seed=index, max_tokens=rng.randint(1, 12), ignore_eos=True))
    engine.add_request("crowded", [1, 2, 3, 4, 5], sampling)
    assert _collect(engine)["crowded"] == alone
    assert engine.runner.compilations == compiled


def _collect(engine):
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output.outputs[0].token_ids
    return outputs


def test_bad_requests_are_rejected_and_the_rest_carry_on(model):
    engine = Engine(model, EngineConfig.from_options(page_size=8, max_num_batched_tokens=32,
                                        max_num_seqs=4, max_model_len=64))
    engine.add_request("good", [1, 2, 3], _greedy(3))
    with pytest.raises(ValueError, match=r"prompt token ids \[9999\] are outside the vocab"):
        engine.add_request("bad", [1, 9999], _greedy(3))
    with pytest.raises(ValueError, match=r"logit_bias token ids \[600\] are outside"):
        engine.add_request("bias", [1], SamplingParams(logit_bias={600: 1.0}))
    with pytest.raises(ValueError, match=r"stop_token_ids \[512\] are outside"):
        engine.add_request("stop", [1], SamplingParams(stop_token_ids=[512]))
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        engine.add_request("text", [1], SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match="a text prompt needs a tokenizer"):
        engine.add_request("text", "hello")
    with pytest.raises(ValueError, match="must be a SamplingParams"):
        engine.add_request("params", [1], {"max_tokens": 3})
    with pytest.raises(ValueError, match="at least one token"):
        engine.add_request("empty", [])
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", [1], _greedy(3))
    with pytest.raises(ValueError, match="no room for output"):
        engine.add_request("long", [1] * 64, _greedy(3))
    assert len(_collect(engine)["good"]) == 3
    assert engine.num_free_pages == engine.config.num_pages - 1


def test_outputs_carry_the_requests_stage_times_and_stats_count_steps_by_tokens(model):
    # max_num_batched_tokens 16: the 40-token prompt takes three chunks before its first
    # token, so its first step comes before its first token.
    config = EngineConfig.from_options(page_size=16, max_num_batched_tokens=16, max_num_seqs=4,
                                       max_model_len=128)
    engine = Engine(model, config)
    engine.add_request("long", list(range(3, 43)), _greedy(3))
    engine.add_request("short", [5, 6, 7], _greedy(3))
    finals, steps = {}, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            times = output.times
            assert times is not None and times.first_scheduled_time is not None
            if output.outputs[0].token_ids:
                assert times.arrival_time <= times.first_scheduled_time \
                    <= times.first_token_time <= times.last_token_time
            if output.finished:
                finals[output.request_id] = times
        steps += 1
    assert set(finals) == {"long", "short"}
    long = finals["long"]
    assert long.queue_seconds >= 0 and long.prefill_seconds > 0
    assert long.inference_seconds >= long.prefill_seconds
    stats = engine.stats()
    assert sum(stats.iteration_tokens) == stats.num_steps == steps
    # Every prompt token once, and every generated token but each request's last as input.
    assert stats.iteration_tokens_sum == 40 + 3 + 2 * (3 - 1)
    assert stats.iteration_tokens[0] == 0  # no step ran a single token here
