"""What every engine offers its callers: the `EngineClient` protocol and `EngineStats`.

`Engine` (one replica) and `DataParallelEngine` (several) both satisfy it, so `LLM`,
`AsyncEngine`, the servers and the multi-host steps hold an `EngineClient` and never ask which
one they have, nor reach through it (`engine.scheduler.kv_cache_manager`, ...). No jax here.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from jaxinfer.engine.host.draft import SpecStats

if TYPE_CHECKING:
    from jaxinfer.config import ModelConfig
    from jaxinfer.engine.config import EngineConfig
    from jaxinfer.engine.device.runner import ModelRunner
    from jaxinfer.engine.input_processor import ProcessedRequest, Prompt
    from jaxinfer.engine.outputs import RequestOutput
    from jaxinfer.engine.sampling_params import SamplingParams
    from jaxinfer.tokenizer import Tokenizer

# Upper bounds of the steps-by-tokens histogram (`EngineStats.iteration_tokens`): vLLM's
# `vllm:iteration_tokens_total` buckets (its CUDA-graph batch sizes, then powers of two).
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def add_counts(*parts: tuple[int, ...]) -> tuple[int, ...]:
    """Element-wise sums of count tuples of any lengths (missing entries count 0)."""
    width = max((len(part) for part in parts), default=0)
    return tuple(sum(part[index] for part in parts if index < len(part))
                 for index in range(width))


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot of an engine's load, for a server's metrics and admission control.

    Attributes:
        num_running: Sequences (samples) scheduled in the running set.
        num_waiting: Sequences waiting for admission (new or preempted).
        kv_cache_usage: Fraction of the page pool held by requests (cached-but-free pages
            count as free: they are evicted on demand).
        prefix_cache_hit_rate: Fraction of admitted prompt tokens served by the prefix cache.
        num_preemptions: Preemptions since the engine was built.
        num_steps: Device steps run since the engine was built.
        num_spec_steps: Request-steps that verified drafts.
        num_draft_tokens: Draft tokens verified.
        num_accepted_tokens: Of those, the accepted ones.
        num_free_pages: Pages free or evictable (the pool's capacity when idle).
        prefix_cache_queries: Prompt tokens looked up in the prefix cache.
        prefix_cache_hits: Of those, the ones found.
        num_unfinished_requests: User requests added and neither finished nor aborted.
        accepted_per_position: Accepted drafts at each draft position
            (`SpecStats.accepted_per_position`).
        iteration_tokens: Steps by the tokens they ran: count i is of the steps with more
            tokens than `ITERATION_TOKEN_BUCKETS[i - 1]` and at most
            `ITERATION_TOKEN_BUCKETS[i]` (the last count: more than every bound).
        iteration_tokens_sum: Tokens run by all steps.
        host_cache_queries: Blocks looked up in the host KV tier (`kv_offload_bytes`), each
            past the end of a device prefix hit.
        host_cache_hits: Of those, the blocks found (and copied back instead of recomputed).
        host_cache_hit_tokens: Admitted prompt tokens loaded from the host tier (a part of
            `prefix_cache_queries`, apart from `prefix_cache_hits`, the device's).
        num_host_blocks: Blocks the host tier holds (0: off).
        num_free_host_blocks: Of those, free or evictable ones (all of them when idle).
        num_swapped_blocks: Blocks preemption swapped to the host tier.
        kv_bytes_to_host: Bytes copied from the device pool to the host tier.
        kv_bytes_to_device: Bytes copied back.
        kv_copy_seconds: Engine-thread seconds spent issuing and collecting those copies.
        kv_copy_blocked_seconds: Of those, seconds spent waiting for a copy to host that had
            not finished while the step ran (the rest overlapped the step).
    """

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_steps: int
    num_spec_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_free_pages: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_unfinished_requests: int = 0
    accepted_per_position: tuple[int, ...] = ()
    iteration_tokens: tuple[int, ...] = ()
    iteration_tokens_sum: int = 0
    host_cache_queries: int = 0
    host_cache_hits: int = 0
    host_cache_hit_tokens: int = 0
    num_host_blocks: int = 0
    num_free_host_blocks: int = 0
    num_swapped_blocks: int = 0
    kv_bytes_to_host: int = 0
    kv_bytes_to_device: int = 0
    kv_copy_seconds: float = 0.0
    kv_copy_blocked_seconds: float = 0.0

    @property
    def host_cache_hit_rate(self) -> float:
        """Host-tier blocks found over blocks looked up there (0 before any lookup)."""
        return self.host_cache_hits / self.host_cache_queries if self.host_cache_queries else 0.0

    @property
    def host_cache_token_hit_rate(self) -> float:
        """Admitted prompt tokens loaded from the host tier, over all admitted prompt tokens."""
        return (self.host_cache_hit_tokens / self.prefix_cache_queries
                if self.prefix_cache_queries else 0.0)

    @property
    def spec(self) -> SpecStats:
        """The speculative-decoding counters, with their rates."""
        return SpecStats(self.num_spec_steps, self.num_draft_tokens, self.num_accepted_tokens,
                         list(self.accepted_per_position))

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted over drafted tokens (0 before any draft)."""
        return self.spec.acceptance_rate


@runtime_checkable
class EngineClient(Protocol):
    """The engine interface: requests in, outputs out, stats and facts.

    Attributes:
        config: The engine's options (resolved).
        model_config: The served model's config (vocabulary, EOS ids, ...).
        tokenizer: For text; None serves token ids only.
    """

    config: EngineConfig
    model_config: ModelConfig
    tokenizer: Tokenizer | None

    def process_request(self, request_id: str, prompt: Prompt,
                        sampling_params: SamplingParams | None = None, *,
                        cache_salt: str | None = None,
                        speculative: bool = True) -> ProcessedRequest:
        """Checks a request without queuing it (any thread); raises `RequestError`."""
        ...

    def add_processed_request(self, processed: ProcessedRequest) -> None:
        """Queues a request `process_request` checked; raises `RequestError` on a duplicate
        id."""
        ...

    def add_request(self, request_id: str, prompt: Prompt,
                    sampling_params: SamplingParams | None = None, *,
                    cache_salt: str | None = None, speculative: bool = True) -> None:
        """`process_request` then `add_processed_request`."""
        ...

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stops a request now and frees its pages; its final output, or None if unknown."""
        ...

    def step(self) -> list[RequestOutput]:
        """Runs one step; the outputs of the requests it changed."""
        ...

    def has_unfinished_requests(self) -> bool:
        ...

    @property
    def num_unfinished_requests(self) -> int:
        ...

    def stats(self) -> EngineStats:
        ...

    def warm_up(self) -> float:
        """Compiles every program the engine will run; returns seconds."""
        ...

    @property
    def compilations(self) -> int:
        """Programs compiled so far (constant after `warm_up`)."""
        ...

    @property
    def runners(self) -> list[ModelRunner]:
        """The device runners, one per data-parallel replica, in replica order (multi-host
        runs send their steps to the other processes)."""
        ...
