"""The draft-model method: greedy output token-identical to reference generation for 64 mixed
requests (preemption forced, aborts), no leaked pages in either cache, no compilation after
warm-up, the drafter's rollback by length, and (slow) the demo models' sampled tokens
distributed as without speculation."""

from __future__ import annotations

import collections
import itertools
import random

import jax
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from jaxinfer.config import get_preset
from jaxinfer.engine.core import Engine, EngineConfig
from jaxinfer.engine.host.request import Request
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.engine.spec.draft_model import DraftSequence
from jaxinfer.generate import generate
from jaxinfer.model_loading import load_model
from jaxinfer.models import create_model

NEW_TOKENS = 10
DRAFT = {"method": "draft_model", "model": "tiny-noisy-copy", "num_tokens": 3,
         "adaptive": False}


@pytest.fixture(scope="module")
def model():
    return create_model(get_preset("tiny"), seed=0)


@pytest.fixture(scope="module")
def drafter():
    """The target with noise on every weight: it agrees with the target often, not always."""
    noisy = create_model(get_preset("tiny"), seed=0)
    graphdef, state = nnx.split(noisy)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    leaves = [leaf + 0.6 * jax.numpy.std(leaf) * jax.random.normal(key, leaf.shape, leaf.dtype)
              for leaf, key in zip(leaves, keys, strict=True)]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


@pytest.fixture(scope="module")
def workload(model):
    """64 prompts of 1 to 150 tokens and their reference greedy outputs and arrival steps."""
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.choice([1, 3, 12, 40, 90, 150]))]
               for _ in range(64)]
    expected = generate(model, prompts, max_new_tokens=NEW_TOKENS, eos_token_ids=())
    arrivals = sorted(rng.randrange(0, 40) for _ in prompts)
    return prompts, expected, arrivals


@pytest.mark.parametrize("gated", [False, True], ids=["fixed", "gate-flipping"])
def test_draft_model_greedy_equals_reference_with_preemption_and_aborts(model, drafter,
                                                                        workload, gated):
    """gated: adaptive, with the throughput gate turning speculation on and off every few
    steps (and the controller granting every request all it has room for while on), so the
    drafter keeps catching up on the tokens of its off stretches."""
    prompts, expected, arrivals = workload
    engine = Engine(model, EngineConfig.from_options(
            page_size=16, max_num_batched_tokens=48, max_num_seqs=8,
                                        max_model_len=256, num_pages=24,
                                        speculative={**DRAFT, "adaptive": gated},
                                        enable_prompt_logprobs=False, bucket_growth=4),
                    draft_model=drafter)
    if gated:
        calls = itertools.count()
        engine.spec_gate.speculate = lambda regime: next(calls) % 6 >= 3
        engine.spec_controller.plan = lambda room, **_: {
            request_id: count for request_id, count in room.items() if count > 0}
    aborted = {"2": 2, "9": 20, "13": 30, "63": 60}
    outputs = {str(i): [] for i in range(len(prompts))}
    pending, step = list(range(len(prompts))), 0
    while pending or engine.has_unfinished_requests():
        while pending and arrivals[pending[0]] <= step:
            index = pending.pop(0)
            engine.add_request(str(index), prompts[index], SamplingParams(
                temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                speculative=index % 3 != 0)
        for request_id, at_step in aborted.items():
            if at_step == step:
                engine.abort_request(request_id)
        for output in engine.step():
            outputs[output.request_id] = output.outputs[0].token_ids
        step += 1
    for index in range(len(prompts)):
        got = outputs[str(index)]
        want = expected[index][:len(got)] if str(index) in aborted else expected[index]
        assert got == want, index
    assert engine.num_preemptions > 0
    assert engine.num_free_pages == engine.config.num_pages - 1
    assert engine.proposer.num_free_pages == engine.config.num_pages - 1
    stats_ = engine.stats()
    assert 0 < stats_.num_accepted_tokens < stats_.num_draft_tokens


def test_draft_model_compiles_nothing_after_warm_up(model, drafter):
    # One token bucket and one sequence bucket: two programs to compile, the test's cost.
    engine = Engine(model, EngineConfig.from_options(
            page_size=8, max_num_batched_tokens=8, max_num_seqs=1,
                                        max_model_len=128, enable_prompt_logprobs=False,
                                        speculative=DRAFT), draft_model=drafter)
    engine.warm_up()
    compiled = engine.compilations
    engine.add_request("greedy", list(range(5, 45)), SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True))
    engine.add_request("sampled", list(range(9, 20)), SamplingParams(
        temperature=0.8, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True))
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                assert output.speculative.num_draft_tokens > 0
    assert engine.compilations == compiled  # neither the target nor the drafter recompiled
    assert engine.proposer.num_free_pages == engine.config.num_pages - 1


def test_greedy_drafts_are_the_drafters_own_greedy_continuation(drafter):
    """The proposer (catch-up step, then the on-device decode loop) against reference
    generation with the drafter, across a rollback: an accepted draft, then a correction."""
    from jaxinfer.engine.device.runner import RunnerConfig
    from jaxinfer.engine.spec.draft_model import DraftModelProposer

    proposer = DraftModelProposer(drafter, RunnerConfig(
        num_pages=40, page_size=4, max_num_batched_tokens=16, max_num_seqs=4,
        max_model_len=64, enable_prompt_logprobs=False), num_tokens=3)
    rng = random.Random(5)
    requests = [Request(str(index), [rng.randrange(3, 512) for _ in range(length)],
                        SamplingParams(temperature=0.0), max_tokens=30)
                for index, length in enumerate((1, 7, 21))]
    for round_ in range(3):
        drafts = proposer.propose(requests)
        expected = generate(drafter, [request.all_token_ids for request in requests],
                            max_new_tokens=3, eos_token_ids=())
        assert [drafts[request.request_id].token_ids for request in requests] == expected, round_
        vocab = drafter.config.vocab_size
        assert all(drafts[request.request_id].probs.shape == (3, vocab) for request in requests)
        for request in requests:  # the target accepts the first draft, then corrects
            tokens = drafts[request.request_id].token_ids
            request.append_output_token(tokens[0])
            request.append_output_token((tokens[1] + 1) % 512)
    proposer.release([request.request_id for request in requests])
    assert proposer.num_free_pages == 39


def test_draft_sequence_rolls_back_to_the_common_prefix():
    request = Request("r", [1, 2, 3], max_tokens=8)
    sequence = DraftSequence(request, [1, 2, 3], num_synced=0, num_computed_tokens=0)
    sequence.sync()
    assert sequence.num_synced == 3 and sequence.num_computed_tokens == 0
    sequence.token_ids += [7, 8]  # drafted 7, 8, 9; fed 7 and 8
    sequence.num_computed_tokens = 5
    for token in (7, 5):  # the target accepted 7 and corrected 8 to 5
        request.append_output_token(token)
    sequence.sync()
    assert sequence.num_computed_tokens == 4 and sequence.token_ids == [1, 2, 3, 7, 5]


def _first_tokens(engine: Engine, prompt: list[int], count: int, params: dict) -> np.ndarray:
    """`[count, 3]` the first three tokens of `count` seeded requests."""
    for seed in range(count):
        engine.add_request(str(seed), prompt, SamplingParams(seed=seed, max_tokens=3,
                                                             ignore_eos=True, **params))
    tokens = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens[int(output.request_id)] = output.outputs[0].token_ids
    return np.asarray([tokens[seed] for seed in range(count)])


def _homogeneity_p_value(first: np.ndarray, second: np.ndarray, min_count: int = 20) -> float:
    """Chi-square test that two samples of token ids come from one distribution (tokens seen
    fewer than `min_count` times in both together are pooled into one cell)."""
    counts = collections.Counter(first.tolist()) + collections.Counter(second.tolist())
    common = sorted(token for token, count in counts.items() if count >= min_count)
    table = np.zeros((2, len(common) + 1))
    for row, sample in enumerate((first, second)):
        for token in sample.tolist():
            table[row, common.index(token) if token in common else -1] += 1
    table = table[:, table.sum(axis=0) > 0]
    return stats.chi2_contingency(table).pvalue


@pytest.mark.slow
def test_demo_models_sample_the_targets_distribution():
    """Tokens 2 and 3 (drawn through the drafter and the verifier; token 1 comes from the
    prefill) against plain sampling of the demo teacher, with temperature and top-k."""
    teacher = load_model("builtin:demo")
    prompt = [1, 450, 1051, 1134, 310]
    options = dict(page_size=16, max_num_batched_tokens=128, max_num_seqs=32, max_model_len=64,
                   enable_prompt_logprobs=False)
    params = dict(temperature=0.9, top_k=30)
    plain = _first_tokens(Engine(teacher, EngineConfig.from_options(
            **options)), prompt, 3000, params)
    # Fixed speculation (not adaptive): the test is about the verified tokens' distribution,
    # so every step must draft, whatever the throughput gate would choose on this machine.
    engine = Engine(teacher, EngineConfig.from_options(**options, speculative={
        "method": "draft_model", "model": "builtin:demo-draft", "num_tokens": 3,
        "adaptive": False}))
    speculative = _first_tokens(engine, prompt, 3000, params)
    assert engine.stats().num_accepted_tokens > 1000
    assert engine.proposer.num_free_pages == engine.config.num_pages - 1
    for position in (0, 1, 2):
        assert _homogeneity_p_value(plain[:, position], speculative[:, position]) > 1e-3
    # The same test notices a distribution that is only slightly off: the teacher at a
    # higher temperature.
    hotter = _first_tokens(Engine(teacher, EngineConfig.from_options(**options)), prompt, 3000,
                           dict(temperature=1.2, top_k=30))
    assert _homogeneity_p_value(plain[:, 1], hotter[:, 1]) < 1e-3


def _greedy_outputs(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, SamplingParams(
            temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output.outputs[0].token_ids
    return [outputs[str(index)] for index in range(len(prompts))]


def test_draft_model_with_an_int8_kv_cache_equals_plain_int8_decoding(model, drafter):
    # Both caches int8 (the drafter's pool inherits the target's kv_cache_dtype): speculation
    # still changes no greedy token, and both pools are whole again afterwards.
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 512) for _ in range(length)] for length in (1, 7, 30, 64)]
    config = {"page_size": 8, "max_num_batched_tokens": 32, "max_num_seqs": 4,
              "max_model_len": 128, "enable_prompt_logprobs": False, "bucket_growth": 4,
              "kv_cache_dtype": "int8"}
    expected = _greedy_outputs(Engine(model, EngineConfig.from_options(**config)), prompts)
    engine = Engine(model, EngineConfig.from_options(
            **config, speculative=DRAFT), draft_model=drafter)
    assert _greedy_outputs(engine, prompts) == expected
    assert engine.stats().num_draft_tokens > 0
    assert engine.num_free_pages == engine.config.num_pages - 1
    assert engine.proposer.num_free_pages == engine.config.num_pages - 1
