"""One generation request as the scheduler tracks it: its tokens, progress and status.

A request's known tokens are its prompt followed by the tokens sampled so far
(`all_token_ids`). `num_computed_tokens` of them have their keys and values in the KV cache;
the scheduler feeds the rest, a chunk per step, and a token is sampled only once every known
token is computed. Preemption resets `num_computed_tokens` to 0 but keeps the sampled tokens,
which are then recomputed together with the prompt.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Iterable, Sequence
from typing import Any

# Process-wide, so that requests built by different front ends still order by creation.
_arrival_counter = itertools.count()


class RequestStatus(enum.Enum):
    """Where a request is in its life; the FINISHED_* members are terminal."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        """Whether the request will never be scheduled again."""
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI-style reason ("stop", "length", "abort"), or None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                       RequestStatus.FINISHED_ABORTED})
_FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: "stop",
                   RequestStatus.FINISHED_LENGTH: "length",
                   RequestStatus.FINISHED_ABORTED: "abort"}


class Request:
    """A prompt to continue, with its stop rules and the scheduler's progress on it.

    Attributes:
        request_id: Unique among the scheduler's unfinished requests.
        prompt_token_ids: The prompt, as a tuple.
        sampling_params: Whatever the caller passed; the scheduler only hands it to the runner.
        max_tokens: Most tokens to generate.
        eos_token_ids: Sampling any of these ends the request (FINISHED_STOPPED).
        ignore_eos: If True, eos tokens do not end the request.
        cache_salt: Mixed into the first block's hash, so requests with different salts never
            share prefix-cache blocks (e.g. per-tenant isolation); None shares freely.
        skip_prefix_cache: Compute the whole prompt even if its blocks are cached (a request
            that wants every prompt position's logprobs needs their logits); its own full
            blocks are still cached for others.
        output_token_ids: Tokens sampled so far.
        num_computed_tokens: Known tokens whose keys and values are in the KV cache.
        status: The current RequestStatus.
        arrival_index: Creation order, unique within the process.
        arrival_time: `time.monotonic()` at creation.
        num_preemptions: How often the request was preempted and had to start over.
        num_cached_tokens: Prompt tokens found in the prefix cache at first admission, or -1
            before it.
        speculate: Whether the engine may propose draft tokens for this request.
        spec_token_ids: Draft tokens for the coming step, recorded by `Scheduler.schedule`
            from the drafts it is given (it feeds them after the request's known tokens, and
            the step verifies them); empty when the request has none.
        spec_draft_probs: `[len(spec_token_ids), V]` the drafter's distributions for those
            drafts, or None for point-mass (n-gram) drafts.
        grammar: The request's structured-output matcher
            (`jaxinfer.engine.structured_output.GrammarMatcher`), or None. The engine
            advances it with every sampled token; the request stops ("stop") once it
            reports the grammar complete (`is_terminated()`).
    """

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int],
                 sampling_params: Any = None, *, max_tokens: int = 16,
                 eos_token_ids: Iterable[int] = (), ignore_eos: bool = False,
                 cache_salt: str | None = None, skip_prefix_cache: bool = False,
                 speculate: bool = False, grammar: Any = None) -> None:
        """Creates a WAITING request with nothing computed.

        Raises:
            ValueError: The prompt is empty or `max_tokens` is not a positive integer.
        """
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt must hold at least one token")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_tokens = {max_tokens!r} must be a "
                             "positive integer")
        self.request_id = request_id
        self.prompt_token_ids = tuple(int(token) for token in prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens
        self.eos_token_ids = tuple(int(token) for token in eos_token_ids)
        self.ignore_eos = ignore_eos
        self.cache_salt = cache_salt
        self.skip_prefix_cache = skip_prefix_cache
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.arrival_index = next(_arrival_counter)
        self.arrival_time = time.monotonic()
        self.num_preemptions = 0
        self.num_cached_tokens = -1
        self.speculate = speculate
        self.spec_token_ids: list[int] = []
        self.spec_draft_probs: Any = None  # [len(spec_token_ids), V] or None
        self.grammar = grammar
        # Prompt and outputs in one list, kept in step with output_token_ids, so that slicing
        # the tokens to feed costs no concatenation per step.
        self._all_token_ids = list(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """The prompt followed by the outputs; a live view, do not modify it."""
        return self._all_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens sampled so far."""
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens: prompt plus outputs."""
        return len(self._all_token_ids)

    @property
    def is_finished(self) -> bool:
        """Whether the request reached a FINISHED_* status."""
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        """Records one sampled token."""
        token_id = int(token_id)
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"prompt={self.num_prompt_tokens}, outputs={self.num_output_tokens}, "
                f"computed={self.num_computed_tokens})")
