"""The continuous-batching scheduler, in vLLM v1's shape: one token budget per step.

Each `schedule()` call spends at most `max_num_batched_tokens` tokens. Running requests come
first, in order: each gets all of its uncomputed known tokens, capped by what is left of the
budget (1 for a decode, a chunk for an unfinished prefill, so chunked prefill falls out of the
budget). Then waiting requests are admitted in FIFO order, each starting after its prefix-cache
hit, while budget, `max_num_seqs` and pages last; the queue's head blocks the rest (no
overtaking), and nothing is admitted in a step that had to preempt.

When a running request cannot get its pages, the newest running request is preempted: its pages
are released, its `num_computed_tokens` reset to 0, and it goes to the front of the waiting
queue, keeping its sampled tokens, which are recomputed with its prompt when it is readmitted.
This repeats until the request fits or is itself the one preempted.

Host KV tier (a `HostBlockPool` given to the scheduler, `kv_offload_bytes` > 0): admission
continues the device prefix hit on the host (`KVCacheManager.get_host_hits`); those tokens
count as computed, and the copies back to the device are planned with the evicted blocks'
copies to the host. With `preemption_mode = "swap"` a victim's full computed blocks are
copied to the host and pinned there (`KVCacheManager.swap_out`) before its pages are freed,
so on readmission the prefix lookup finds them. Each output carries the step's planned
copies (`SchedulerOutput.kv_transfers`), which the engine must issue before running the
step, also when the output schedules nothing (a step that only preempted may have swapped).

Speculative decoding: `schedule(drafts)` takes the step's drafts (a `Draft` per request id,
from the engine's proposer) and records them on its running requests
(`Request.spec_token_ids`); a running request whose known tokens all fit in the step also gets
its drafts, as far as the budget, its
`max_tokens` and `max_model_len` allow, so the target scores the last known token plus R drafts
in the same ragged step (R + 1 tokens of the budget). `update_from_output` then takes the
accepted drafts plus one token, and rolls the request back by length: `num_computed_tokens`
drops by the rejected drafts, whose pages are freed (no page is copied; the garbage they hold
past the computed length is overwritten later), before full blocks are cached, so a rejected
draft never enters the prefix cache.

The engine loop alternates `schedule()` -> run the model -> `update_from_output()`; every
non-empty SchedulerOutput must be run and reported before the next `schedule()`, which is what
makes it safe to hand out and cache blocks on the host before the device has written them.

Invariants: every added request is in exactly one of `waiting` and `running` until it finishes
or is aborted, and then in neither; a finished or aborted request holds no pages, so once every
request is done the pool's `num_free_blocks` equals its capacity.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from jaxinfer.engine.config import CacheConfig, SchedulerConfig, SchedulerConfigError
from jaxinfer.engine.host.draft import Draft
from jaxinfer.engine.host.host_block_pool import HostBlockPool, KVTransfers
from jaxinfer.engine.host.kv_cache_manager import KVCacheManager
from jaxinfer.engine.host.request import Request, RequestStatus


@dataclasses.dataclass
class ScheduledRequest:
    """What the runner needs to compute one request's share of a step.

    Attributes:
        request_id: The request.
        token_ids: Tokens to feed this step.
        positions: Their positions, `start .. start + len(token_ids) - 1`, where start is the
            request's computed tokens before this step.
        block_table: The request's blocks, covering every position up to the last one fed.
        needs_sample: Whether the chunk reaches the request's last known token, so that a token
            must be sampled from its last position; False for a prefill chunk that stops early.
        spec_token_ids: Draft tokens fed after the known ones (the tail of `token_ids`), to be
            verified this step; empty when not speculating.
        spec_draft_probs: `[len(spec_token_ids), V]` the drafter's distributions, or None for
            point-mass (n-gram) drafts.
        num_output_tokens: Tokens the request had sampled before this step (the index of the
            token sampled now, e.g. to derive a per-request PRNG key that survives preemption).
        sampling_params: The request's sampling parameters, as given.
        prompt_token_ids: The request's whole prompt (repetition penalty, prompt logprobs).
        output_token_ids: The tokens it sampled before this step (frequency and presence
            penalties, min_tokens); a live view, valid until `update_from_output`.
        grammar: The request's structured-output matcher (`Request.grammar`), or None; the
            runner asks it for the allowed tokens of the token sampled this step.
    """

    request_id: str
    token_ids: list[int]
    positions: list[int]
    block_table: list[int]
    needs_sample: bool
    num_output_tokens: int
    sampling_params: Any
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    spec_token_ids: list[int] = dataclasses.field(default_factory=list)
    spec_draft_probs: Any = None  # [len(spec_token_ids), V] or None
    grammar: Any = None

    @property
    def start_position(self) -> int:
        """Position of the first token fed (the request's computed tokens before this step)."""
        return self.positions[0]

    @property
    def num_tokens(self) -> int:
        """Tokens fed this step."""
        return len(self.token_ids)

    @property
    def context_length(self) -> int:
        """Tokens in the KV cache once this step has run (the last position plus one)."""
        return self.positions[-1] + 1


@dataclasses.dataclass
class SchedulerOutput:
    """One step's batch.

    Attributes:
        scheduled_requests: The requests to run, running ones first, then newly admitted ones.
        num_scheduled_tokens: Tokens fed this step, over all requests (<= the budget).
        preempted_request_ids: Requests preempted in this step.
        finished_request_ids: Requests that finished or were aborted since the previous step,
            so that the runner can drop whatever it keeps per request.
        kv_transfers: Copies between the device pool and the host tier to issue before the
            step (empty without a host tier).
    """

    scheduled_requests: list[ScheduledRequest]
    num_scheduled_tokens: int
    preempted_request_ids: list[str]
    finished_request_ids: list[str]
    kv_transfers: KVTransfers = dataclasses.field(default_factory=KVTransfers)

    @property
    def is_empty(self) -> bool:
        """Whether nothing is to be run."""
        return not self.scheduled_requests


@dataclasses.dataclass
class RequestOutput:
    """New tokens of one request after a step.

    Attributes:
        request_id: The request.
        new_token_ids: Tokens sampled this step and kept (none after a stop token).
        status: The request's status after the step.
        num_draft_tokens: Draft tokens verified for the request this step.
        num_accepted_tokens: Of those, the accepted ones.
    """

    request_id: str
    new_token_ids: list[int]
    status: RequestStatus
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def finished(self) -> bool:
        """Whether the request finished in this step."""
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI-style reason ("stop", "length"), or None while the request runs on."""
        return self.status.finish_reason


class Scheduler:
    """Decides, step by step, which tokens of which requests to compute.

    Attributes:
        config: The limits.
        kv_cache_manager: Block tables and prefix cache of the scheduler's requests.
        waiting: Requests to admit, in order (preempted ones at the front).
        running: Admitted requests, oldest admission first.
    """

    def __init__(self, config: SchedulerConfig, cache: CacheConfig,
                 host_pool: HostBlockPool | None = None) -> None:
        """Creates an idle scheduler with an empty pool.

        Args:
            config: The step's limits, `max_model_len` resolved.
            cache: The page pool, `num_pages` resolved (the null page included).
            host_pool: The host KV tier (built by the engine from `cache.kv_offload_bytes`
                and the pool's shapes), or None.

        Raises:
            SchedulerConfigError: Unresolved sizes, or a pool that cannot hold one
                `max_model_len` sequence (it could never make progress).
        """
        if config.max_model_len is None or cache.num_pages is None:
            raise SchedulerConfigError("the scheduler needs max_model_len and num_pages "
                                       "resolved (EngineConfig.resolved)")
        # A request alone must always fit, or preemption could never make it progress.
        needed = cache.pages_per_sequence(config.max_model_len) + 1
        if cache.num_pages < needed:
            raise SchedulerConfigError(
                f"scheduler config field 'num_pages' = {cache.num_pages!r}: must be >= "
                f"{needed}: one max_model_len = {config.max_model_len} sequence needs "
                f"{needed - 1} blocks of {cache.page_size} tokens, plus the null block")
        self.config = config
        self.cache = cache
        self.kv_cache_manager = KVCacheManager(cache.num_pages, cache.page_size,
                                               cache.enable_prefix_caching, host_pool)
        self._swap = host_pool is not None and cache.preemption_mode == "swap"
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._requests: dict[str, Request] = {}
        self._finished_since_last_step: list[str] = []
        # The non-empty output that still awaits update_from_output, and the request objects
        # it scheduled (an id aborted and then reused must not receive the old step's tokens).
        self._pending_output: SchedulerOutput | None = None
        self._pending_requests: dict[str, Request] = {}

    # ------------------------------------------------------------------ requests

    def add_request(self, request: Request) -> None:
        """Queues a new request at the back of the waiting queue.

        Raises:
            ValueError: The id is already in use, the request is not fresh (WAITING, nothing
                computed or sampled), or its prompt leaves no room for an output token within
                max_model_len.
        """
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if (request.status is not RequestStatus.WAITING or request.num_computed_tokens
                or request.output_token_ids):
            raise ValueError(f"request {request.request_id!r} is not fresh: {request!r}")
        if request.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(f"request {request.request_id!r}: prompt of "
                             f"{request.num_prompt_tokens} tokens leaves no room for output "
                             f"within max_model_len = {self.config.max_model_len}")
        self._requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> bool:
        """Ends a request now, wherever it is, and releases its pages.

        Tokens the runner returns for it from an already scheduled step are ignored.

        Returns:
            True if the request was unfinished; False if the id is unknown (e.g. the request
            already finished, which a client's late cancel can race with).
        """
        return bool(self.abort_requests([request_id]))

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Ends several requests at once (`abort_request` for each, in one pass over the
        queues: aborting the n samples of one request one by one would take O(n^2)).

        Returns:
            The ids that were unfinished (the others are ignored, as `abort_request` does).
        """
        requests = [request for request in map(self._requests.pop, request_ids,
                                                itertools.repeat(None)) if request is not None]
        if not requests:
            return []
        gone = {id(request) for request in requests}
        if any(request.status is RequestStatus.RUNNING for request in requests):
            self.running = [request for request in self.running if id(request) not in gone]
        if any(request.status is not RequestStatus.RUNNING for request in requests):
            self.waiting = collections.deque(request for request in self.waiting
                                             if id(request) not in gone)
        for request in requests:
            self._finish(request, RequestStatus.FINISHED_ABORTED)
        return [request.request_id for request in requests]

    def get_request(self, request_id: str) -> Request | None:
        """Returns the unfinished request with that id, or None."""
        return self._requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        """Requests waiting or running."""
        return len(self._requests)

    # ------------------------------------------------------------------ one step

    def schedule(self, drafts: Mapping[str, Draft] | None = None) -> SchedulerOutput:
        """Picks this step's tokens: running requests first, then waiting ones (FIFO).

        Args:
            drafts: Draft tokens per running request id, proposed for this step; a running
                request without an entry has none (earlier drafts are never reused).

        Returns:
            The batch. The requests' `num_computed_tokens` already count its tokens.

        Raises:
            RuntimeError: The previous non-empty output was not reported with
                `update_from_output`.
            ValueError: A draft for a request that is not running; nothing is changed then.
        """
        if self._pending_output is not None:
            raise RuntimeError("schedule() called before update_from_output() reported the "
                               "previous step")
        self._record_drafts(drafts or {})
        manager = self.kv_cache_manager
        budget = self.config.max_num_batched_tokens
        chosen: list[tuple[Request, int, list[int]]] = []
        preempted: list[Request] = []

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_known = request.num_tokens - request.num_computed_tokens
            num_new_tokens = min(num_known, budget)
            drafts = (self._drafts_that_fit(request, budget - num_new_tokens)
                      if num_new_tokens == num_known else [])
            while manager.allocate_slots(request, num_new_tokens + len(drafts),
                                         num_lookahead_tokens=len(drafts)) is None:
                # The newest running request is at the end; it was not chosen yet, because
                # requests are chosen in order and it is at or after `index`.
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                chosen.append((request, num_new_tokens, drafts))
                budget -= num_new_tokens + len(drafts)
                index += 1
                continue
            break  # The request preempted itself, so it was the last running one.

        # Admitting while preempting would only take pages a running request is short of.
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            hit_blocks, num_hit_tokens = ([], 0) if request.skip_prefix_cache else (
                manager.get_computed_blocks(request))
            host_slots = [] if request.skip_prefix_cache else (
                manager.get_host_hits(request, len(hit_blocks)))
            num_hit_tokens += len(host_slots) * manager.block_size
            num_new_tokens = min(request.num_tokens - num_hit_tokens, budget)
            if manager.allocate_slots(request, num_new_tokens, hit_blocks,
                                      host_hit_slots=host_slots) is None:
                break
            manager.release_swapped(request.request_id)  # its blocks are found again
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            self.running.append(request)
            chosen.append((request, num_new_tokens, []))
            budget -= num_new_tokens

        scheduled = [self._describe(request, num_new_tokens, drafts)
                     for request, num_new_tokens, drafts in chosen]
        output = SchedulerOutput(
            scheduled_requests=scheduled,
            num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
            preempted_request_ids=[request.request_id for request in preempted],
            finished_request_ids=self._finished_since_last_step,
            kv_transfers=manager.take_transfers(),
        )
        self._finished_since_last_step = []
        if scheduled:
            self._pending_output = output
            self._pending_requests = {request.request_id: request for request, _, _ in chosen}
        return output

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           sampled_token_ids: dict[str, list[int]]) -> list[RequestOutput]:
        """Records a step's sampled tokens, finishes requests that stop, caches full blocks.

        Args:
            scheduler_output: The output of the latest `schedule()`.
            sampled_token_ids: For each scheduled request with `needs_sample`, its sampled
                tokens: one, or for a request with drafts its accepted drafts followed by one
                token; requests aborted since the step was scheduled may be present or not and
                are ignored.

        Returns:
            One RequestOutput per request that got tokens, in scheduling order.

        Raises:
            RuntimeError: `scheduler_output` is not the output awaiting its update.
            ValueError: Tokens are missing for a request that needs a sample, given for one
                that does not or was not scheduled, or are not its drafts' prefix plus one
                token; nothing is changed then.
        """
        if scheduler_output is not self._pending_output:
            if scheduler_output.is_empty and not sampled_token_ids:
                return []
            raise RuntimeError("this SchedulerOutput is not the one awaiting its update")
        needs_sample = {scheduled.request_id: scheduled.needs_sample
                        for scheduled in scheduler_output.scheduled_requests}
        drafts = {scheduled.request_id: scheduled.spec_token_ids
                  for scheduled in scheduler_output.scheduled_requests}
        for request_id, tokens in sampled_token_ids.items():
            if not needs_sample.get(request_id, False) and tokens:
                raise ValueError(f"request {request_id!r} was not scheduled to sample, "
                                 f"yet got tokens {list(tokens)}")
            proposed = drafts.get(request_id, [])
            if proposed and list(tokens[:-1]) != proposed[:len(tokens) - 1]:
                raise ValueError(f"request {request_id!r}: tokens {list(tokens)} are not a "
                                 f"prefix of its drafts {proposed} plus one token")
        live = {request_id: request for request_id, request in self._pending_requests.items()
                if self._requests.get(request_id) is request}
        for request_id, sample in needs_sample.items():
            if sample and request_id in live and not sampled_token_ids.get(request_id):
                raise ValueError(f"request {request_id!r} needs a sampled token and got none")
        self._pending_output = None
        self._pending_requests = {}

        outputs = []
        for scheduled in scheduler_output.scheduled_requests:
            request = live.get(scheduled.request_id)
            if request is None:
                continue  # Aborted after this step was scheduled.
            num_drafts = len(scheduled.spec_token_ids)
            num_accepted = 0
            if num_drafts:
                num_accepted = len(sampled_token_ids[scheduled.request_id]) - 1
                self._roll_back(request, num_drafts, num_accepted)
            # The step has run, so the blocks its tokens filled hold their keys and values.
            self.kv_cache_manager.cache_full_blocks(request)
            if not scheduled.needs_sample:
                continue
            new_tokens = []
            status = RequestStatus.RUNNING
            for token in sampled_token_ids[scheduled.request_id]:
                request.append_output_token(token)
                new_tokens.append(request.output_token_ids[-1])
                status = self._stop_status(request)
                if status.is_finished:
                    break
            if status.is_finished:
                del self._requests[request.request_id]
                self.running.remove(request)
                self._finish(request, status)
            outputs.append(RequestOutput(request.request_id, new_tokens, status, num_drafts,
                                         num_accepted))
        return outputs

    # ------------------------------------------------------------------ helpers

    def _record_drafts(self, drafts: Mapping[str, Draft]) -> None:
        """Gives each running request its draft for this step, or none."""
        running = {request.request_id: request for request in self.running}
        strays = sorted(set(drafts) - set(running))
        if strays:
            raise ValueError(f"drafts for requests that are not running: {strays}")
        for request_id, request in running.items():
            draft = drafts.get(request_id)
            request.spec_token_ids = list(draft.token_ids) if draft is not None else []
            request.spec_draft_probs = draft.probs if draft is not None else None

    def draft_room(self, request: Request) -> int:
        """The most drafts the request's length limits allow it this step (may be <= 0).

        All R drafts accepted emit R + 1 tokens, which must stay within `max_tokens` and
        `max_model_len` (so every fed position also has a page-table slot).
        """
        return min(request.max_tokens - request.num_output_tokens - 1,
                   self.config.max_model_len - request.num_tokens - 1)

    def _drafts_that_fit(self, request: Request, budget: int) -> list[int]:
        """The request's drafts that fit the step's remaining budget and its length limits."""
        room = min(budget, self.draft_room(request))
        return request.spec_token_ids[:max(room, 0)]

    def _roll_back(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """Uncounts the rejected drafts and frees the pages that held only them."""
        request.num_computed_tokens -= num_drafts - num_accepted
        self.kv_cache_manager.free_excess_blocks(request)

    def _describe(self, request: Request, num_new_tokens: int,
                  drafts: list[int]) -> ScheduledRequest:
        """Builds the request's ScheduledRequest and counts its tokens (and drafts) as
        computed."""
        start = request.num_computed_tokens
        end = start + num_new_tokens
        request.num_computed_tokens = end + len(drafts)
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start:end] + list(drafts),
            positions=list(range(start, end + len(drafts))),
            block_table=self.kv_cache_manager.get_block_table(request.request_id),
            needs_sample=end == request.num_tokens,
            num_output_tokens=request.num_output_tokens,
            sampling_params=request.sampling_params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            spec_token_ids=list(drafts),
            spec_draft_probs=(request.spec_draft_probs[:len(drafts)]
                              if drafts and request.spec_draft_probs is not None else None),
            grammar=request.grammar,
        )

    def _preempt(self, request: Request) -> None:
        """Releases a running request's pages (swapping its full blocks to the host tier
        first in "swap" mode) and puts it at the front of the waiting queue."""
        if self._swap:
            self.kv_cache_manager.swap_out(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def _stop_status(self, request: Request) -> RequestStatus:
        """Returns the status after the request's latest token: a FINISHED_* one or RUNNING."""
        if not request.ignore_eos and request.output_token_ids[-1] in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if request.grammar is not None and request.grammar.is_terminated():
            return RequestStatus.FINISHED_STOPPED  # structured output complete
        if (request.num_output_tokens >= request.max_tokens
                or request.num_tokens >= self.config.max_model_len):
            return RequestStatus.FINISHED_LENGTH
        return RequestStatus.RUNNING

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Marks a request finished (already out of every queue) and releases its pages."""
        request.status = status
        self.kv_cache_manager.free(request)
        self.kv_cache_manager.release_swapped(request.request_id)
        self._finished_since_last_step.append(request.request_id)
