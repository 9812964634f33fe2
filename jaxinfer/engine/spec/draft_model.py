"""The draft-model proposer: a small model with its own paged KV cache drafts R tokens a step.

A `jaxinfer.engine.spec.proposer.Proposer`. The drafter is a second `ModelRunner` (its own
page pool on device, its own compiled bucketed steps, returning each drawn token's
distribution q), driven through its public interface only (`execute` with `ScheduledRequest`s
it builds, `sequence_bucket`, `run_on_cache` for the decode loop), with its own host-side
`KVCacheManager` (prefix caching off: drafter pages are cheap and private). For each
speculating request it keeps a `DraftSequence`: the tokens it has fed and how many of them sit
in its cache. It reads the engine's requests and never writes to them: drafts go back as
`Draft`s.

Each engine step, for the decoding requests, the drafter

1. rolls back: tokens it drafted and the target rejected are uncounted, by length, and the
   pages past the kept length go back to the pool (no copies; later writes overwrite them);
2. catches up on the request's tokens it has not computed (the whole prompt the first time,
   chunked by the token budget; afterwards the target's correction or bonus token);
3. draws x_1 from the last position with the request's own sampling parameters (so q gets the
   same temperature/top-k/top-p transform as the target's p), then feeds x_j to draw x_{j+1}
   for j = 1 .. R - 1 in one jitted call (`decode_loop`: R - 1 one-token steps over the
   drafter's paged cache, slots computed on device from the page tables, batched over every
   drafting request and bucketed by sequence count), since a separate dispatch per draft
   would cost about as much as the target step it saves.

Drafter keys never repeat: each draw uses the request's seed salted for the drafter and a
per-request draw counter, so a draft is independent of every earlier draft and of the
verifier's coins, which exactness needs.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.engine.device.runner import ModelRunner, RunnerConfig, SampledToken
from jaxinfer.engine.device.sampler import (
    SamplingArrays,
    build_sampling_arrays,
    greedy_rows,
    sample_tokens,
)
from jaxinfer.engine.host.draft import Draft
from jaxinfer.engine.host.kv_cache_manager import KVCacheManager
from jaxinfer.engine.host.request import Request
from jaxinfer.engine.host.scheduler import ScheduledRequest
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.engine.spec.verify import sampling_probabilities
from jaxinfer.models import PagedBatch, PagedKVCache, Transformer

# Mixed into a request's seed so the drafter's stream differs from the verifier's.
_DRAFT_SEED_SALT = 0x5EED_D4AF


@dataclasses.dataclass
class DraftSequence:
    """The drafter's view of one request (a `KVCacheManager` `TokenSequence` of its own).

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


def drafter_runner_config(target_config: RunnerConfig) -> RunnerConfig:
    """The drafter runner's sizes: the target's pages, buckets and lengths, returning each
    drawn token's distribution, without prompt logprobs, drafts or a quantized cache."""
    return dataclasses.replace(
        target_config, enable_prompt_logprobs=False, num_speculative_tokens=0,
        draft_distributions=False, return_probabilities=True, cache_dtype=None)


class DraftModelProposer:
    """Proposes R drafts (and their distributions) per request with a small model.

    Args:
        model: The drafter; it must share the target's vocabulary.
        target_config: The target runner's config (pages, buckets, lengths are reused).
        num_tokens: R, the drafts per request and step.

    Attributes:
        num_steps: Drafter device steps run so far (the draft cost, in steps).
        seconds: Wall seconds spent proposing (the draft cost, in time).
    """

    def __init__(self, model: Transformer, target_config: RunnerConfig, num_tokens: int) -> None:
        self.num_tokens = num_tokens
        self.config = drafter_runner_config(target_config)
        self.runner = ModelRunner(model, self.config)
        self.kv_cache_manager = KVCacheManager(self.config.num_pages, self.config.page_size,
                                               enable_prefix_caching=False)
        self._sequences: dict[str, DraftSequence] = {}
        self.num_steps = 0
        self.seconds = 0.0
        self._decode = jax.jit(self._decode_loop, donate_argnums=(1, 2))

    @property
    def compilations(self) -> int:
        """Drafter programs compiled so far (constant after `warm_up`)."""
        return self.runner.compilations + self._decode._cache_size()

    @property
    def num_free_pages(self) -> int:
        """Drafter pages free (its pool's capacity once no request holds any)."""
        return self.kv_cache_manager.num_free_blocks

    def warm_up(self) -> float:
        """Compiles the drafter's steps and decode loops; returns seconds."""
        started = time.perf_counter()
        self.runner.warm_up()
        if self.num_tokens > 1:
            for num_seqs in self.config.sequence_buckets:
                self._run_decode([], num_seqs)
        return time.perf_counter() - started

    def time_drafts(self, repeats: int = 3) -> dict[tuple[int, bool], float]:
        """Seconds of one proposal on padding, per (sequence bucket, whether the decode loop
        runs): the drafter step of the smallest token bucket holding one token per sequence,
        plus the loop; the fastest of `repeats`. Call after `warm_up` (compiles nothing).

        Returns:
            A starting point for `jaxinfer.engine.spec.controller.DraftCosts`.
        """
        steps = self.runner.time_steps(repeats)  # (token bucket, False) -> seconds
        timings = {}
        for num_seqs in self.config.sequence_buckets:
            step = steps[(self.runner.token_bucket(num_seqs), False)]
            timings[(num_seqs, False)] = step
            if self.num_tokens > 1:
                best = float("inf")
                for _ in range(repeats):
                    started = time.perf_counter()
                    self._run_decode([], num_seqs)
                    best = min(best, time.perf_counter() - started)
                timings[(num_seqs, True)] = step + best
        return timings

    def release(self, request_ids: Iterable[str]) -> None:
        """Frees the drafter pages of requests that finished or were aborted."""
        for request_id in request_ids:
            sequence = self._sequences.pop(request_id, None)
            if sequence is not None:
                self.kv_cache_manager.free(sequence)

    def propose(self, requests: Sequence[Request],
                num_tokens: Mapping[str, int] | None = None) -> dict[str, Draft]:
        """Drafts, with their `[R, V]` distributions, for the (decoding) requests.

        A request gets at most `num_tokens[id]` drafts (default R; when no request gets more
        than one, the decode loop does not run), fewer near its `max_tokens` or
        `max_model_len`, and none when the drafter's pool has no room for it this step.
        """
        started = time.perf_counter()
        drafts = self._propose(requests, num_tokens or {})
        self.seconds += time.perf_counter() - started
        return drafts

    def _propose(self, requests: Sequence[Request],
                 limits: Mapping[str, int]) -> dict[str, Draft]:
        wanted: dict[str, int] = {}
        work: list[tuple[DraftSequence, list[int]]] = []
        for request in requests:
            count = min(self.num_tokens, limits.get(request.request_id, self.num_tokens),
                        request.max_tokens - request.num_output_tokens - 1,
                        self.config.max_model_len - request.num_tokens - 1)
            if count < 1:
                continue
            sequence = self._sequence(request)
            sequence.sync()
            self.kv_cache_manager.free_excess_blocks(sequence)
            wanted[request.request_id] = count
            work.append((sequence, sequence.token_ids[sequence.num_computed_tokens:]))
        by_id = {sequence.request_id: sequence for sequence, _ in work}
        first = self._feed(work)  # x_1 of every sequence that caught up
        longer = []
        for request_id, token in first.items():
            sequence = by_id[request_id]
            count = wanted[request_id] - 1
            # Pages for x_1 .. x_{count}, fed by the decode loop; none left: x_1 only.
            if count and self.kv_cache_manager.allocate_slots(
                    sequence, count, num_lookahead_tokens=count) is not None:
                longer.append((sequence, token.token_id, count))
        later = self._decode_all(longer)
        drafts = {}
        for request in requests:
            token = first.get(request.request_id)
            if token is None:
                continue
            more_tokens, more_probs = later.get(request.request_id, ([], []))
            drafts[request.request_id] = Draft(
                [token.token_id, *more_tokens],
                np.stack([token.probabilities, *more_probs]))  # [R, V]
        return drafts

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
                    sequence, len(chunk))
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

    def _decode_all(self, work: list[tuple[DraftSequence, int, int]]
                    ) -> dict[str, tuple[list[int], list[np.ndarray]]]:
        """Feeds each sequence's x_1 and draws x_2 .. x_{count + 1} in one device call.

        Args:
            work: (sequence, x_1, count) per sequence, its pages already allocated for count
                more tokens.

        Returns:
            Per request id, its `count` further drafts and their `[V]` distributions.
        """
        if not work:
            return {}
        num_seqs = self.runner.sequence_bucket(len(work))
        tokens, probs = self._run_decode(work, num_seqs)  # [Q, R - 1], [Q, R - 1, V]
        result = {}
        for row, (sequence, first, count) in enumerate(work):
            drawn = tokens[row, :count].tolist()
            sequence.token_ids += [first, *drawn[:-1]]
            sequence.num_computed_tokens += count
            sequence.num_draws += count
            result[sequence.request_id] = (drawn, list(probs[row, :count]))
        self.num_steps += 1
        return result

    def _run_decode(self, work: list[tuple[DraftSequence, int, int]],
                    num_seqs: int) -> tuple[np.ndarray, np.ndarray]:
        """Packs the decode loop's `[Q]` rows (padding rows write nothing) and runs it."""
        config = self.config
        first_tokens = np.zeros(num_seqs, np.int32)  # [Q]
        positions = np.zeros(num_seqs, np.int32)  # [Q] position of x_1
        counts = np.zeros(num_seqs, np.int32)  # [Q] tokens to feed (x_1 .. x_count)
        page_indices = np.zeros((num_seqs, config.pages_per_sequence),
                                np.int32)  # [Q, pages_per_sequence]
        seeds = np.zeros(num_seqs, np.uint32)  # [Q]
        draw_index = np.zeros(num_seqs, np.int32)  # [Q]
        params = []
        for row, (sequence, first, count) in enumerate(work):
            table = self.kv_cache_manager.get_block_table(sequence.request_id)
            first_tokens[row], positions[row], counts[row] = first, sequence.num_tokens, count
            page_indices[row, :len(table)] = table
            draft_params = _draft_params(sequence.request)
            params.append(draft_params)
            seeds[row] = draft_params.seed if draft_params is not None else 0
            draw_index[row] = sequence.num_draws
        sampling = build_sampling_arrays(
            params, self.runner.model_config.vocab_size,
            prompt_token_ids=[sequence.request.prompt_token_ids for sequence, _, _ in work],
            output_token_ids=[()] * len(work), batch_size=num_seqs)
        drawn = self.runner.run_on_cache(
            self._decode, first_tokens, positions, counts, page_indices,
            np.asarray([len(work)], np.int32), sampling, seeds, draw_index)  # num_seqs: [1]
        return jax.device_get(drawn)  # [Q, R - 1], [Q, R - 1, V]

    def _decode_loop(self, state: nnx.State, pages: jax.Array, scales: jax.Array | None,
                     first_tokens: jax.Array, positions: jax.Array, counts: jax.Array,
                     page_indices: jax.Array, num_seqs: jax.Array, sampling: SamplingArrays,
                     seeds: jax.Array, draw_index: jax.Array
                     ) -> tuple[jax.Array, jax.Array | None, tuple[jax.Array, jax.Array]]:
        """R - 1 one-token drafter steps on device: feed x_j at its position, draw x_{j+1}.

        Rows past `counts` (or past `num_seqs`) keep computing but write no page slot, so
        every row has the same shapes and the loop compiles once per sequence bucket.

        Returns:
            The updated pages and (int8 cache) scales, and (`[Q, R - 1]` drawn tokens,
            `[Q, R - 1, V]` their distributions (zeros when every row is greedy)).
        """
        model = self.runner.merge(state)
        rows = first_tokens.shape[0]
        page_size = self.config.page_size
        real = jnp.arange(rows) < num_seqs[0]  # [Q]
        cu_q_lens = jnp.minimum(jnp.arange(rows + 1), num_seqs[0]).astype(jnp.int32)  # [Q + 1]
        token = first_tokens  # [Q]
        drawn, distributions = [], []
        for step in range(self.num_tokens - 1):
            position = positions + step  # [Q]
            writes = real & (step < counts)  # [Q]
            page = jnp.take_along_axis(
                page_indices, jnp.minimum(position // page_size,
                                          page_indices.shape[1] - 1)[:, None], axis=1)[:, 0]  # [Q]
            slots = jnp.where(writes, page * page_size + position % page_size, -1)  # [Q]
            kv_lens = jnp.where(real, position + 1, 0).astype(jnp.int32)  # [Q]
            batch = PagedBatch(slots.astype(jnp.int32), kv_lens, page_indices, cu_q_lens,
                               num_seqs)  # [Q], [Q], [Q, pages_per_sequence], [Q + 1], [1]
            hidden, cache = model.hidden_states(token[None], position[None],
                                                PagedKVCache(pages, batch,
                                                             scales))  # [1, Q, D]
            pages, scales = cache.pages, cache.scales  # [L, P, Z, 2K, H], [L, P, Z, 2K]
            logits = model.logits(hidden)[0]  # [Q, V]
            keys = jax.vmap(lambda seed, index: jax.random.fold_in(jax.random.key(seed),
                                                                   index))(
                seeds, draw_index + step)  # [Q]
            token = sample_tokens(logits, keys, sampling)[0]  # [Q]
            drawn.append(token)
            distributions.append(jax.lax.cond(
                jnp.all(greedy_rows(sampling)),
                functools.partial(jnp.zeros, logits.shape, jnp.float32),
                functools.partial(sampling_probabilities, logits, sampling)))  # [Q, V]
        return pages, scales, (jnp.stack(drawn, axis=1),  # [Q, R - 1]
                               jnp.stack(distributions, axis=1))  # [Q, R - 1, V]

    def _describe(self, sequence: DraftSequence, chunk: list[int],
                  needs_sample: bool) -> ScheduledRequest:
        """The drafter step's entry for one sequence; counts the chunk as computed."""
        start = sequence.num_computed_tokens
        sequence.num_computed_tokens += len(chunk)
        request = sequence.request
        draft_params = _draft_params(request)
        index = sequence.num_draws
        if needs_sample:
            sequence.num_draws += 1
        return ScheduledRequest(
            request_id=request.request_id, token_ids=list(chunk),
            positions=list(range(start, start + len(chunk))),
            block_table=self.kv_cache_manager.get_block_table(request.request_id),
            needs_sample=needs_sample, num_output_tokens=index, sampling_params=draft_params,
            prompt_token_ids=request.prompt_token_ids, output_token_ids=())


def _draft_params(request: Request) -> SamplingParams | None:
    """The request's sampling parameters with the drafter's own seed (salted, so its stream
    differs from the verifier's) and no min_tokens (the engine drafts only once it no longer
    applies)."""
    params = request.sampling_params
    if params is None:
        return None
    seed = params.seed if params.seed is not None else hash(request.request_id)
    return dataclasses.replace(params, seed=(seed ^ _DRAFT_SEED_SALT) % (2 ** 32), min_tokens=0)
