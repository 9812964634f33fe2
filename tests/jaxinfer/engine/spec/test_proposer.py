"""The proposer interface: a fake proposer plugged into an engine has its drafts scheduled and
verified; greedy output stays the reference, a proposer that knows the reference is always
accepted and one that proposes garbage never is, and the counters say so."""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence

import pytest

from jaxinfer.config import get_preset
from jaxinfer.engine.client import add_counts
from jaxinfer.engine.config import SpeculativeConfig
from jaxinfer.engine.core import Engine, EngineConfig
from jaxinfer.engine.host.draft import Draft, SpecStats
from jaxinfer.engine.host.request import Request
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.engine.spec.ngram import NgramProposer
from jaxinfer.engine.spec.proposer import Proposer
from jaxinfer.generate import generate
from jaxinfer.models import create_model

NUM_DRAFTS = 3
NEW_TOKENS = 12
# Sizes only (the fake drafts); fixed R, so every request drafts every step.
SPECULATIVE = {"method": "ngram", "num_tokens": NUM_DRAFTS, "adaptive": False}


class _ReferenceProposer:
    """Proposes the next tokens of each request's reference greedy continuation, optionally
    spoiled (every draft token shifted, so never the greedy one)."""

    def __init__(self, references: dict[str, list[int]], vocab: int, spoil: bool = False):
        self.references = references  # request id -> prompt + reference outputs
        self.vocab = vocab
        self.spoil = spoil
        self.proposed_for: set[str] = set()
        self.released: list[str] = []

    def propose(self, requests: Sequence[Request],
                num_tokens: Mapping[str, int] | None = None) -> dict[str, Draft]:
        drafts = {}
        for request in requests:
            known = request.num_tokens
            tokens = self.references[request.request_id][known:known + NUM_DRAFTS]
            if self.spoil:
                tokens = [(token + 1) % self.vocab for token in tokens]
            if tokens:
                drafts[request.request_id] = Draft(tokens)
                self.proposed_for.add(request.request_id)
        return drafts

    def release(self, request_ids: Iterable[str]) -> None:
        self.released += list(request_ids)

    def warm_up(self) -> float:
        return 0.0

    @property
    def compilations(self) -> int:
        return 0


@pytest.fixture(scope="module")
def model():
    return create_model(get_preset("tiny"), seed=0)


@pytest.fixture(scope="module")
def workload(model):
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 512) for _ in range(length)] for length in (1, 5, 17, 30)]
    expected = generate(model, prompts, max_new_tokens=NEW_TOKENS, eos_token_ids=())
    references = {str(index): prompt + output
                  for index, (prompt, output) in enumerate(zip(prompts, expected, strict=True))}
    return prompts, expected, references


def _generate(model, proposer, prompts):
    engine = Engine(model, EngineConfig.from_options(
        page_size=4, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=64,
        enable_prompt_logprobs=False, speculative=SPECULATIVE), proposer=proposer)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, params)
    outputs, per_request = {}, SpecStats()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output.outputs[0].token_ids
                for name in ("num_spec_steps", "num_draft_tokens", "num_accepted_tokens"):
                    setattr(per_request, name,
                            getattr(per_request, name) + getattr(output.speculative, name))
                per_request.accepted_per_position = list(add_counts(
                    per_request.accepted_per_position,
                    output.speculative.accepted_per_position))
    assert engine.num_free_pages == engine.config.num_pages - 1
    return engine, [outputs[str(index)] for index in range(len(prompts))], per_request


@pytest.mark.parametrize("spoil", [False, True], ids=["reference", "garbage"])
def test_drafts_flow_through_scheduling_and_verification(model, workload, spoil):
    prompts, expected, references = workload
    proposer = _ReferenceProposer(references, model.config.vocab_size, spoil=spoil)
    assert isinstance(proposer, Proposer)
    engine, got, per_request = _generate(model, proposer, prompts)
    assert got == expected  # greedy speculation never changes the output
    assert proposer.proposed_for == set(references)
    assert sorted(proposer.released) == sorted(references)  # all finished, all released
    stats = engine.stats().spec
    assert stats == engine.spec_stats == per_request  # per request adds up to the engine's
    assert stats.num_spec_steps > 0 and stats.num_draft_tokens > 0
    if spoil:
        assert stats.num_accepted_tokens == 0 and stats.acceptance_rate == 0.0
        assert stats.mean_accepted_length == 0.0
    else:
        # Every draft is the greedy token, so every verified draft is accepted.
        assert stats.acceptance_rate == 1.0
        assert stats.mean_accepted_length > 1
        # Accepted drafts save steps: fewer than one decode step per token.
        assert engine.num_steps < NEW_TOKENS


def test_a_proposer_needs_speculative_options(model, workload):
    with pytest.raises(ValueError, match="speculative"):
        Engine(model, EngineConfig.from_options(max_model_len=64),
               proposer=_ReferenceProposer(workload[2], model.config.vocab_size))


def test_ngram_proposer_drafts_prompt_lookups_only_where_found():
    proposer = NgramProposer(SpeculativeConfig(method="ngram", num_tokens=2, max_ngram=2))
    assert isinstance(proposer, Proposer)
    found, none = Request("found", [1, 2, 3, 9, 1, 2]), Request("none", [4, 5, 6])
    assert proposer.propose([found, none]) == {"found": Draft([3, 9])}
    assert found.spec_token_ids == []  # a proposer never writes to the scheduler's requests
