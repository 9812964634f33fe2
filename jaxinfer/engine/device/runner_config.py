"""The runner's static sizes (`RunnerConfig`) and the padding buckets its programs are
compiled for, apart from the runner so the host-side pieces that size copies and drafts
(`kv_offload`, the draft model, proposers) share them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxinfer.engine.sampling_params import MAX_LOGPROBS


def power_of_two_buckets(smallest: int, largest: int, growth: int = 2) -> tuple[int, ...]:
    """`smallest, growth * smallest, ...` up to and including `largest`."""
    buckets, size = [], smallest
    while size < largest:
        buckets.append(size)
        size *= growth
    buckets.append(largest)
    return tuple(buckets)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunnerConfig:
    """Static sizes of the device step.

    Attributes:
        num_pages: Pages in the pool (page 0 is the null page padding rows point to).
        page_size: Tokens per page.
        max_num_batched_tokens: The largest token bucket (the scheduler's token budget).
        max_num_seqs: The largest sequence bucket.
        max_model_len: Longest sequence; fixes the page-table width.
        cache_dtype: KV page dtype (default: the model's compute dtype); "int8", "fp8_e4m3",
            "fp8_e5m2" keep 8-bit pages with a float32 scale per token and KV head; "int4",
            "int2" keep KIVI's packed pages with a float32 residual pool of one page per
            sequence seat (`max_num_seqs` seats, handed out per request, see `release`).
        min_token_bucket: The smallest token bucket.
        max_logprobs: M, the top logprobs computed per token when a request asks for any.
        enable_prompt_logprobs: Allow the step that returns prompt logprobs (compiled per
            token bucket on first use).
        bucket_growth: Ratio of consecutive token buckets: 2 pads least, 4 compiles fewer
            programs (faster warm-up) at up to 4x padding.
        num_speculative_tokens: R, the most draft tokens a request may bring to a step
            (0: no speculative decoding).
        draft_distributions: Whether drafts come with the drafter's distributions (a draft
            model) rather than as point masses (prompt lookup).
        return_probabilities: Also return each sampled token's whole distribution (after the
            sampler's transform), as a drafter must for verification.
    """

    num_pages: int
    page_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    cache_dtype: str | None = None
    min_token_bucket: int = 8
    max_logprobs: int = MAX_LOGPROBS
    enable_prompt_logprobs: bool = True
    bucket_growth: int = 2
    num_speculative_tokens: int = 0
    draft_distributions: bool = False
    return_probabilities: bool = False

    def __post_init__(self) -> None:
        for name in ("num_pages", "page_size", "max_num_batched_tokens", "max_num_seqs",
                     "max_model_len", "min_token_bucket"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)}: must be >= 1")
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens = {self.num_speculative_tokens}: must "
                             "be >= 0")
        if self.bucket_growth < 2:
            raise ValueError(f"bucket_growth = {self.bucket_growth}: must be >= 2")
        if self.num_pages < 2:
            raise ValueError(f"num_pages = {self.num_pages}: page 0 is reserved, need >= 2")
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError(f"max_num_seqs = {self.max_num_seqs} exceeds "
                             f"max_num_batched_tokens = {self.max_num_batched_tokens}: every "
                             "scheduled sequence brings at least one token")

    @property
    def pages_per_sequence(self) -> int:
        """Page-table width: enough pages for `max_model_len` tokens."""
        return -(-self.max_model_len // self.page_size)

    @property
    def token_buckets(self) -> tuple[int, ...]:
        """Padded token counts the step is compiled for: powers of `bucket_growth` from
        `min_token_bucket`, and always a bucket of one token. A batch-1 decode step (one
        user, the latency case) padded to 8 rows multiplied 8 rows by every weight: on
        SmolLM2-135M Q4_1 on a CPU, 8 rows of the weight kernels' work against 1."""
        buckets = power_of_two_buckets(min(self.min_token_bucket, self.max_num_batched_tokens),
                                       self.max_num_batched_tokens, self.bucket_growth)
        return buckets if buckets[0] == 1 else (1, *buckets)

    def sequences_for(self, num_tokens: int) -> int:
        """Q, the per-sequence rows of the step for token bucket `num_tokens`: a step never
        has more sequences than tokens, nor more than `max_num_seqs`."""
        return min(num_tokens, self.max_num_seqs)

    @property
    def sequence_buckets(self) -> tuple[int, ...]:
        """Padded sequence counts of programs that run over sequences only (the draft
        model's decode loop), not of the step."""
        return power_of_two_buckets(1, self.max_num_seqs, self.bucket_growth)


def bucket_for(size: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds `size`.

    Raises:
        ValueError: `size` exceeds the largest bucket.
    """
    for bucket in buckets:
        if size <= bucket:
            return bucket
    raise ValueError(f"{size} exceeds the largest bucket {buckets[-1]}")
