"""The draft-model proposer: a small model with its own paged KV cache drafts k tokens a step.

The drafter is a second `ModelRunner` (its own page pool on device, its own compiled bucketed
steps, returning each drawn token's distribution q) with its own host-side `KVCacheManager`
(prefix caching off: drafter pages are cheap and private). For each speculating request it
keeps a `DraftSequence`: the tokens it has fed and how many of them sit in its cache.

Each engine step, for the decoding requests, the drafter

1. rolls back: tokens it drafted and the target rejected are uncounted, by length, and the
   pages past the kept length go back to the pool (no copies; later writes overwrite them);
2. catches up on the request's tokens it has not computed (the whole prompt the first time,
   chunked by the token budget; afterwards the target's correction or bonus token);
3. draws x_1 from the last position with the request's own sampling parameters (so q gets the
   same temperature/top-k/top-p transform as the target's p), then feeds x_j to draw x_{j+1},
   batched over every drafting request, k steps in all.

Drafter keys never repeat: each draw uses the request's seed salted for the drafter and a
per-request draw counter, so a draft is independent of every earlier draft and of the
verifier's coins, which exactness needs.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence

import numpy as np

from jaxinfer.engine.kv_cache_manager import KVCacheManager
from jaxinfer.engine.request import Request
from jaxinfer.engine.runner import ModelRunner, RunnerConfig, SampledToken
from jaxinfer.engine.scheduler import ScheduledRequest
from jaxinfer.models import Transformer

# Mixed into a request's seed so the drafter's stream differs from the verifier's.
_DRAFT_SEED_SALT = 0x5EED_D4AF


@dataclasses.dataclass
class DraftSequence:
    """The drafter's view of one request (duck-types the fields `KVCacheManager` reads).

    Attributes:
        request: The target's request this shadows (an id reused by a new request gets a
            fresh DraftSequence).
        token_ids: The request's known tokens as of the last proposal, then the drafts fed.
        num_synced: How many leading `token_ids` are the request's own tokens.
        num_computed_tokens: Leading `token_ids` whose keys and values are in the drafter's
            cache.
        num_draws: Tokens drawn so far (the drafter's PRNG counter).
    """

    request: Request
    token_ids: list[int]
    num_synced: int
    num_computed_tokens: int = 0
    num_draws: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def sync(self) -> None:
        """Rolls back to the longest prefix the request really has and adopts its tokens."""
        real = self.request.all_token_ids
        kept = self.num_synced
        limit = min(self.num_computed_tokens, len(real))
        while kept < limit and self.token_ids[kept] == real[kept]:
            kept += 1
        self.num_computed_tokens = min(self.num_computed_tokens, kept)
        self.token_ids = list(real)
        self.num_synced = len(real)


class DraftModelProposer:
    """Proposes k drafts (and their distributions) per request with a small model.

    Args:
        model: The drafter; it must share the target's vocabulary.
        target_config: The target runner's config (pages, buckets, lengths are reused).
        num_tokens: k.

    Attributes:
        num_steps: Drafter device steps run so far (the draft cost, in steps).
        seconds: Wall seconds spent proposing (the draft cost, in time).
    """

    def __init__(self, model: Transformer, target_config: RunnerConfig, num_tokens: int) -> None:
        self.num_tokens = num_tokens
        self.config = dataclasses.replace(
            target_config, enable_prompt_logprobs=False, num_speculative_tokens=0,
            draft_distributions=False, return_probabilities=True, cache_dtype=None)
        self.runner = ModelRunner(model, self.config)
        self.kv_cache_manager = KVCacheManager(self.config.num_pages, self.config.page_size,
                                               enable_prefix_caching=False)
        self._sequences: dict[str, DraftSequence] = {}
        self.num_steps = 0
        self.seconds = 0.0

    @property
    def num_free_pages(self) -> int:
        """Drafter pages free (its pool's capacity once no request holds any)."""
        return self.kv_cache_manager.num_free_blocks

    def warm_up(self) -> float:
        """Compiles the drafter's steps; returns seconds."""
        return self.runner.warm_up()

    def release(self, request_ids: Iterable[str]) -> None:
        """Frees the drafter pages of requests that finished or were aborted."""
        for request_id in request_ids:
            sequence = self._sequences.pop(request_id, None)
            if sequence is not None:
                self.kv_cache_manager.free(sequence)  # type: ignore[arg-type]

    def propose(self, requests: Sequence[Request], max_model_len: int) -> None:
        """Sets `spec_token_ids` and `spec_draft_probs` of each (decoding) request.

        A request gets fewer than k drafts near its `max_tokens` or `max_model_len`, and none
        when the drafter's pool has no room for it this step.
        """
        started = time.perf_counter()
        self._propose(requests, max_model_len)
        self.seconds += time.perf_counter() - started

    def _propose(self, requests: Sequence[Request], max_model_len: int) -> None:
        wanted: dict[str, int] = {}
        work: list[tuple[DraftSequence, list[int]]] = []
        for request in requests:
            count = min(self.num_tokens, request.max_tokens - request.num_output_tokens - 1,
                        max_model_len - request.num_tokens - 1)
            if count < 1:
                continue
            sequence = self._sequence(request)
            sequence.sync()
            self.kv_cache_manager.free_excess_blocks(sequence)  # type: ignore[arg-type]
            wanted[request.request_id] = count
            work.append((sequence, sequence.token_ids[sequence.num_computed_tokens:]))
        drafts: dict[str, list[int]] = {request_id: [] for request_id in wanted}
        probs: dict[str, list[np.ndarray]] = {request_id: [] for request_id in wanted}
        by_id = {sequence.request_id: sequence for sequence, _ in work}
        for _ in range(self.num_tokens):
            sampled = self._feed(work)
            work = []
            for request_id, token in sampled.items():
                drafts[request_id].append(token.token_id)
                probs[request_id].append(token.probabilities)
                if len(drafts[request_id]) < wanted[request_id]:
                    sequence = by_id[request_id]
                    sequence.token_ids.append(token.token_id)
                    work.append((sequence, [token.token_id]))
            if not work:
                break
        for request in requests:
            request_drafts = drafts.get(request.request_id)
            if request_drafts:
                request.spec_token_ids = request_drafts
                request.spec_draft_probs = np.stack(probs[request.request_id])  # [k, V]

    def _sequence(self, request: Request) -> DraftSequence:
        sequence = self._sequences.get(request.request_id)
        if sequence is None or sequence.request is not request:
            self.release([request.request_id])
            sequence = DraftSequence(request, list(request.all_token_ids), 0)
            self._sequences[request.request_id] = sequence
        return sequence

    def _feed(self, work: list[tuple[DraftSequence, list[int]]]) -> dict[str, SampledToken]:
        """Feeds each sequence its tokens (chunked over as many drafter steps as the budget
        needs) and draws the next token of every sequence whose tokens were all fed."""
        sampled: dict[str, SampledToken] = {}
        queue = [(sequence, tokens) for sequence, tokens in work if tokens]
        while queue:
            batch: list[ScheduledRequest] = []
            rest: list[tuple[DraftSequence, list[int]]] = []
            budget = self.config.max_num_batched_tokens
            for sequence, tokens in queue:
                if budget == 0 or len(batch) == self.config.max_num_seqs:
                    rest.append((sequence, tokens))
                    continue
                chunk = tokens[:budget]
                allocated = self.kv_cache_manager.allocate_slots(
                    sequence, len(chunk))  # type: ignore[arg-type]
                if allocated is None:
                    continue  # no drafter pages: this request drafts nothing more this step
                batch.append(self._describe(sequence, chunk, len(chunk) == len(tokens)))
                budget -= len(chunk)
                if len(chunk) < len(tokens):
                    rest.append((sequence, tokens[len(chunk):]))
            if not batch:
                break
            sampled.update(self.runner.execute(batch).sampled)
            self.num_steps += 1
            queue = rest
        return sampled

    def _describe(self, sequence: DraftSequence, chunk: list[int],
                  needs_sample: bool) -> ScheduledRequest:
        """The drafter step's entry for one sequence; counts the chunk as computed."""
        start = sequence.num_computed_tokens
        sequence.num_computed_tokens += len(chunk)
        request = sequence.request
        params = request.sampling_params
        seed = params.seed if params is not None and params.seed is not None else hash(
            request.request_id)
        draft_params = None if params is None else dataclasses.replace(
            params, seed=(seed ^ _DRAFT_SEED_SALT) % (2 ** 32),
            min_tokens=0)  # the engine drafts only once min_tokens no longer applies
        index = sequence.num_draws
        if needs_sample:
            sequence.num_draws += 1
        return ScheduledRequest(
            request_id=request.request_id, token_ids=list(chunk),
            positions=list(range(start, start + len(chunk))),
            block_table=self.kv_cache_manager.get_block_table(request.request_id),
            needs_sample=needs_sample, num_output_tokens=index, sampling_params=draft_params,
            prompt_token_ids=request.prompt_token_ids, output_token_ids=())
