"""Speculative decoding in the engine: greedy output token-identical to reference generation
for 64 mixed speculating and plain requests (preemption forced, prefix caching on), with R
drafts every step and with the adaptive controller choosing them, no leaked pages after aborts,
rollback by length, no compilation after warm-up."""

from __future__ import annotations

import random

import pytest

from jaxinfer.config import get_preset
from jaxinfer.engine.config import SpeculativeConfig
from jaxinfer.engine.core import Engine, EngineConfig
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.engine.spec.ngram import propose_ngram
from jaxinfer.generate import generate
from jaxinfer.models import create_model

NEW_TOKENS = 10
NGRAM = {"method": "ngram", "num_tokens": 3, "max_ngram": 3, "adaptive": False}
ADAPTIVE = {**NGRAM, "adaptive": True}


@pytest.fixture(scope="module")
def model():
    return create_model(get_preset("tiny"), seed=0)


@pytest.fixture(scope="module")
def workload(model):
    """64 prompts of 1 to 300 tokens, many repeating a passage (so prompt lookup finds
    matches), some sharing a prefix; their reference greedy outputs and arrival steps."""
    rng = random.Random(0)
    shared = [rng.randrange(3, 512) for _ in range(40)]
    prompts = []
    for index in range(64):
        length = rng.choice([1, 3, 12, 40, 90, 150])
        passage = [rng.randrange(3, 512) for _ in range(length)]
        prompt = passage * 2 if index % 2 else passage  # a copy-heavy half
        if index % 5 == 0 and len(prompt) > 40:
            prompt[:40] = shared
        prompts.append(prompt)
    expected = generate(model, prompts, max_new_tokens=NEW_TOKENS, eos_token_ids=())
    arrivals = sorted(rng.randrange(0, 40) for _ in prompts)
    return prompts, expected, arrivals


def _run(engine, prompts, arrivals, abort=()):
    """Feeds the requests at their arrival steps (every third one not speculating)."""
    outputs = {str(i): [] for i in range(len(prompts))}
    pending = list(range(len(prompts)))
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and arrivals[pending[0]] <= step:
            index = pending.pop(0)
            engine.add_request(str(index), prompts[index], SamplingParams(
                temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                speculative=index % 3 != 0)
        for request_id, at_step in abort:
            if at_step == step:
                engine.abort_request(request_id)
        for output in engine.step():
            outputs[output.request_id] = output.outputs[0].token_ids  # cumulative
        step += 1
    return [outputs[str(i)] for i in range(len(prompts))]


def _check(engine, workload, aborted=None, require_acceptance=True):
    """Runs the workload; every request equals the reference (an aborted one, its prefix),
    no page is left held, and drafts were verified (some, not all, accepted; with
    `require_acceptance=False` some drafted, which the adaptive gate decides from this
    machine's step times, so on a loaded machine only a few may be drafted and none kept)."""
    prompts, expected, arrivals = workload
    aborted = aborted or {}
    got = _run(engine, prompts, arrivals, abort=aborted.items())
    for index, tokens in enumerate(got):
        if str(index) in aborted:
            assert tokens == expected[index][:len(tokens)], index
        else:
            assert tokens == expected[index], index
    assert engine.num_free_pages == engine.config.num_pages - 1
    stats = engine.stats()
    assert stats.num_draft_tokens > 0
    if require_acceptance:
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.num_accepted_tokens <= stats.num_draft_tokens


def test_ngram_greedy_equals_reference_with_preemption_and_aborts(model, workload):
    # bucket_growth=4: fewer step programs to compile, the test's main cost.
    engine = Engine(model, EngineConfig.from_options(
            page_size=16, max_num_batched_tokens=48, max_num_seqs=8,
                                        max_model_len=320, num_pages=24, bucket_growth=4,
                                        speculative=NGRAM))
    # Some aborted mid-prefill, some mid-decode (arrivals run to step 40).
    _check(engine, workload, aborted={"1": 2, "9": 20, "13": 30, "63": 60},
           require_acceptance=False)
    assert engine.num_preemptions > 0
    assert engine.prefix_cache_hit_rate > 0


def test_adaptive_greedy_equals_reference_with_preemption_and_aborts(model, workload):
    """The gate decides per step whether to speculate and the controller how many drafts
    each request gets (timings of this machine, so which ones varies); the tokens never do."""
    engine = Engine(model, EngineConfig.from_options(
            page_size=16, max_num_batched_tokens=48, max_num_seqs=8, max_model_len=320,
            num_pages=24, bucket_growth=4, enable_prompt_logprobs=False,
            speculative=ADAPTIVE))
    engine.warm_up()
    compiled = engine.compilations
    _check(engine, workload, aborted={"1": 2, "9": 20, "13": 30, "63": 60},
           require_acceptance=False)
    assert engine.num_preemptions > 0
    assert engine.compilations == compiled
    controller = engine.spec_controller
    assert controller is not None and controller.stats.num_request_steps > 0
    assert controller.stats.num_planned_drafts >= engine.stats().num_draft_tokens
    assert not controller._acceptance and not controller._last_drafted  # all released
    # The gate explores plain windows first, then speculating ones (by step count, not time).
    gate = engine.spec_gate.stats
    assert gate.num_off_steps > 0 and gate.num_on_steps > 0


@pytest.mark.slow
def test_ngram_greedy_equals_reference_without_preemption(model, workload):
    engine = Engine(model, EngineConfig.from_options(
            page_size=8, max_num_batched_tokens=32, max_num_seqs=8,
                                        max_model_len=320, speculative=NGRAM))
    _check(engine, workload)
    assert engine.num_preemptions == 0


def test_speculation_compiles_nothing_after_warm_up(model):
    engine = Engine(model, EngineConfig.from_options(
            page_size=8, max_num_batched_tokens=16, max_num_seqs=2,
                                        max_model_len=128, enable_prompt_logprobs=False,
                                        bucket_growth=4, speculative=NGRAM))
    engine.warm_up()
    compiled = engine.runner.compilations
    passage = list(range(5, 25))
    engine.add_request("copy", passage * 3, SamplingParams(temperature=0.0, max_tokens=20,
                                                           ignore_eos=True))
    engine.add_request("sampled", passage * 2, SamplingParams(temperature=0.8, seed=1,
                                                              max_tokens=20, ignore_eos=True))
    engine.add_request("plain", passage, SamplingParams(max_tokens=8, logprobs=2))
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished and output.request_id != "plain":
                assert output.speculative.num_draft_tokens > 0
            if output.request_id == "plain":
                assert output.speculative is None
    assert engine.runner.compilations == compiled


def test_propose_ngram_takes_the_latest_match_of_the_longest_suffix():
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3], 2, 3) == [7, 8]
    assert propose_ngram([4, 1, 2, 5, 1, 2, 6, 6, 2], 3, 3) == [6, 6, 2]
    assert propose_ngram([4, 1, 2, 5, 1, 2, 6, 1, 2], 3, 3) == [6, 1, 2]
    assert propose_ngram([1, 2, 3], 4, 3) == []
    assert propose_ngram([7, 7], 4, 3) == [7]
    assert propose_ngram([1, 2, 1], 4, 3, min_ngram=2) == []


def test_speculative_config_rejects_bad_options():
    with pytest.raises(ValueError, match="must be one of"):
        SpeculativeConfig.parse({"method": "medusa", "num_tokens": 2})
    with pytest.raises(ValueError, match="unknown speculative options"):
        SpeculativeConfig.parse({"method": "ngram", "num_tokens": 2, "k": 1})
    with pytest.raises(ValueError, match="'model' is required"):
        SpeculativeConfig.parse({"method": "draft_model", "num_tokens": 2})
    with pytest.raises(ValueError, match="num_tokens = 0"):
        SpeculativeConfig.parse({"method": "ngram", "num_tokens": 0})
