"""The synchronous engine loop: schedule on the host, run one device step, update.

    engine = Engine(model, EngineConfig(max_num_seqs=16))
    engine.add_request("a", [1, 450, 7483], SequenceSampling(), max_tokens=32)
    while engine.has_unfinished_requests():
        for output in engine.step():
            ...  # output.request_id, output.new_token_ids, output.finished

`step()` is vLLM v1's loop body: `Scheduler.schedule()` decides which tokens of which
requests to compute within the token budget; `ModelRunner.execute` packs them, runs the
jitted step over the paged cache and samples; `Scheduler.update_from_output` appends the
tokens, stops finished requests and releases their pages. The scheduler never touches device
arrays and the runner never makes scheduling decisions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxinfer.engine.request import Request
from jaxinfer.engine.runner import ModelRunner, RunnerConfig
from jaxinfer.engine.scheduler import RequestOutput, Scheduler, SchedulerConfig
from jaxinfer.models import Transformer


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Engine options (vLLM's names where they exist).

    Attributes:
        page_size: Tokens per KV-cache page (vLLM's block_size).
        num_pages: Pages in the pool, the null page included; None sizes it for
            `max_num_seqs` sequences of `max_model_len` tokens.
        max_num_batched_tokens: Token budget of one step (prefill chunks and decodes).
        max_num_seqs: Most requests running at once.
        max_model_len: Longest sequence; None means the model's max_position_embeddings.
        enable_prefix_caching: Share the KV pages of identical full prompt blocks.
        cache_dtype: KV page dtype; None means the model's compute dtype.
    """

    page_size: int = 16
    num_pages: int | None = None
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 16
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    cache_dtype: str | None = None

    def resolved(self, model_max_len: int) -> EngineConfig:
        """This config with the None fields filled in for a model."""
        max_model_len = self.max_model_len or model_max_len
        pages_per_sequence = -(-max_model_len // self.page_size)
        num_pages = self.num_pages or self.max_num_seqs * pages_per_sequence + 1
        return dataclasses.replace(self, max_model_len=max_model_len, num_pages=num_pages)


class Engine:
    """Continuous batching over one model: add requests at any time, call `step()`."""

    def __init__(self, model: Transformer, config: EngineConfig | None = None) -> None:
        """Builds the scheduler, the page pool and the jitted step (not yet compiled).

        Raises:
            ValueError: An invalid config (the field is named).
        """
        config = (config or EngineConfig()).resolved(model.config.max_position_embeddings)
        self.config = config
        self.model_config = model.config
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs, block_size=config.page_size,
            num_blocks=config.num_pages, enable_prefix_caching=config.enable_prefix_caching,
            max_model_len=config.max_model_len))
        self.runner = ModelRunner(model, RunnerConfig(
            num_pages=config.num_pages, page_size=config.page_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
            cache_dtype=config.cache_dtype))
        self.num_steps = 0
        self.num_preemptions = 0

    def warm_up(self) -> float:
        """Compiles every bucket of the device step; returns the seconds it took."""
        return self.runner.warm_up()

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    sampling_params: Any = None, *, max_tokens: int = 16,
                    eos_token_ids: Sequence[int] | None = None, ignore_eos: bool = False,
                    cache_salt: str | None = None) -> None:
        """Queues a request; it joins the running batch at the next step that has room.

        Args:
            request_id: Unique among unfinished requests.
            prompt_token_ids: The prompt, at least one token.
            sampling_params: None (greedy) or an object with `temperature`, `top_k`, `top_p`
                and `seed` attributes.
            max_tokens: Most tokens to generate.
            eos_token_ids: Stop tokens; None means the model's.
            ignore_eos: Generate past the stop tokens.
            cache_salt: Keeps this request's prefix-cache blocks apart from other salts.

        Raises:
            ValueError: An empty prompt, a duplicate id, a token id outside the vocabulary,
                or a prompt that leaves no room for output within max_model_len.
        """
        vocab = self.model_config.vocab_size
        bad = [token for token in prompt_token_ids if not 0 <= int(token) < vocab]
        if bad:
            raise ValueError(f"request {request_id!r}: prompt token ids {bad[:5]} are outside "
                             f"the vocabulary [0, {vocab})")
        eos = self.model_config.eos_token_ids if eos_token_ids is None else eos_token_ids
        self.scheduler.add_request(Request(
            request_id, prompt_token_ids, sampling_params, max_tokens=max_tokens,
            eos_token_ids=eos, ignore_eos=ignore_eos, cache_salt=cache_salt))

    def abort_request(self, request_id: str) -> bool:
        """Stops a request now and frees its pages; False if it was not unfinished."""
        return self.scheduler.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Runs one scheduling step; returns the requests that got tokens or finished."""
        scheduled = self.scheduler.schedule()
        self.num_preemptions += len(scheduled.preempted_request_ids)
        if scheduled.is_empty:
            return []
        sampled = self.runner.execute(scheduled.scheduled_requests)
        self.num_steps += 1
        return self.scheduler.update_from_output(
            scheduled, {request_id: [token] for request_id, token in sampled.items()})

    @property
    def num_free_pages(self) -> int:
        """Pages free or evictable (the pool's capacity when the engine is idle)."""
        return self.scheduler.kv_cache_manager.num_free_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Fraction of looked-up prompt blocks found in the prefix cache."""
        return self.scheduler.kv_cache_manager.prefix_cache_hit_rate
