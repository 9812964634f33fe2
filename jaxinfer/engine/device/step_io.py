"""The device step's typed inputs and outputs, which are also the multi-host wire format.

`ModelRunner.prepare` packs the scheduled requests into a `StepInputs` of host (numpy)
arrays; `ModelRunner.run` feeds it to the jitted step, which returns a `StepOutputs` of
device arrays. A multi-host leader sends the same `StepInputs` down the step channel, so the
followers run the same program on the same values. Both are NamedTuples, so they are pytrees
(jit, `jax.tree.map` and `jax.device_get` walk them; a None field is an empty subtree) and
pickle by name.

Which program runs (the plain step or the one that also returns prompt logprobs) is a static
choice made beside the inputs, not a field: it selects a different compiled program.

`ModelRunner.execute` returns a `RunnerOutput` (host values: each request's `SampledToken`,
its `PromptLogprobs`, its accepted drafts), or raises `RequestsFailedError` when packing failed
because of some requests alone.

Shapes use the project's one legend, `jaxinfer/typing.py`. Here T is the step's token bucket,
Q its sequence bucket (<= max_num_seqs), R the runner's `num_speculative_tokens` and M its
`max_logprobs`; a page table is `[Q, pages_per_sequence]` (the runner's page-table width).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
from jax import Array

from jaxinfer.engine.device.sampler import SamplingArrays
from jaxinfer.models import PagedBatch

# The runner's two step programs; `StepInputs` are the same for both.
STEP = "step"
PROMPT_STEP = "prompt_step"
STEP_KINDS = (STEP, PROMPT_STEP)


class StepInputs(NamedTuple):
    """One step's host inputs, padded to its (T, Q) buckets.

    Padding tokens write no page slot (slot -1) and padding sequences have no tokens, so a
    step of padding only (warm-up) changes nothing.
    """

    token_ids: Array  # [T] int32, every sequence's fed tokens, back to back
    positions: Array  # [T] int32, each token's position in its sequence
    # slot_mapping [T], kv_lens [Q], page_indices [Q, pages_per_sequence],
    # cu_q_lens [Q + 1], num_seqs [1]
    batch: PagedBatch
    last_token_index: Array  # [Q] int32, index in T of each sequence's last fed token
    sampling: SamplingArrays  # [Q] / [Q, V] / [Q, ceil(V / 32)] per-sequence sampling settings
    seeds: Array  # [Q] uint32, each sequence's PRNG seed
    output_index: Array  # [Q] int32, tokens the sequence sampled before this step
    want_logprobs: Array  # [Q] bool, whether the sequence asked for top logprobs
    next_token_ids: Array  # [T] int32, the prompt token after each fed one (prompt logprobs)
    draft_token_ids: Array  # [Q, R] int32, drafts to verify (the tail of the fed tokens)
    num_draft_tokens: Array  # [Q] int32, drafts per sequence, in [0, R]
    draft_probs: Array | None = None  # [Q, R, V] float32, the drafter's q; None: point masses


class StepOutputs(NamedTuple):
    """One step's results (device arrays, replicated on a mesh).

    The optional fields are None when the runner does not compute them: `probabilities`
    without `return_probabilities`, the prompt fields in the plain step, the speculative
    fields without `num_speculative_tokens`.
    """

    tokens: Array  # [Q] int32, the token sampled after each sequence's last fed token
    logprobs: Array  # [Q] float32, its log-probability
    top_ids: Array  # [Q, M] int32, the most likely tokens (zeros if no row wants them)
    top_logprobs: Array  # [Q, M] float32, their log-probabilities
    probabilities: Array | None = None  # [Q, V] float32, the distribution sampled from
    prompt_logprobs: Array | None = None  # [T] float32, log p(next prompt token | prefix)
    prompt_top_ids: Array | None = None  # [T, M] int32, the most likely tokens per position
    prompt_top_logprobs: Array | None = None  # [T, M] float32, their log-probabilities
    spec_tokens: Array | None = None  # [Q, R + 1] int32, accepted drafts then one more token
    num_accepted: Array | None = None  # [Q] int32, accepted drafts per sequence


# ---------------------------------------------------------------------- what the runner returns


@dataclasses.dataclass(frozen=True)
class SampledToken:
    """The token sampled for one request in a step, with its logprobs.

    Attributes:
        token_id: The sampled token.
        logprob: Its log-probability (after bias, penalties and min_tokens; see
            `jaxinfer.engine.device.sampler`).
        top_token_ids: `[M]` the M most likely tokens, most likely first (M is the runner's
            `max_logprobs`; empty when no request of the step asked for logprobs).
        top_logprobs: `[M]` their log-probabilities.
        probabilities: `[V]` the distribution the token was drawn from (after temperature,
            min_p, top-k and top-p), with `return_probabilities`; else None. Zeros when the
            whole step was greedy (greedy drafts are verified by argmax, not by q).
    """

    token_id: int
    logprob: float
    top_token_ids: np.ndarray
    top_logprobs: np.ndarray
    probabilities: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
    """Log-probabilities of a run of prompt tokens, from one prefill chunk.

    Attributes:
        first_position: Prompt position of the first token described (>= 1: the first prompt
            token has nothing before it to predict it).
        logprobs: `[num_positions]` each token's log-probability given the tokens before it
            (raw logits), for the chunk's `num_positions` prompt positions from
            `first_position` on.
        top_token_ids: `[num_positions, M]` the M most likely tokens at each of those positions.
        top_logprobs: `[num_positions, M]` their log-probabilities.
    """

    first_position: int
    logprobs: np.ndarray
    top_token_ids: np.ndarray
    top_logprobs: np.ndarray


@dataclasses.dataclass
class RunnerOutput:
    """What one step produced.

    Attributes:
        sampled: Per request with `needs_sample`, its token.
        prompt_logprobs: Per request that asked for prompt logprobs and fed prompt tokens
            with a successor this step, their logprobs.
        speculated: Per request that brought drafts, its new tokens: the accepted drafts and
            one more (such requests are not in `sampled`).
    """

    sampled: dict[str, SampledToken]
    prompt_logprobs: dict[str, PromptLogprobs]
    speculated: dict[str, list[int]] = dataclasses.field(default_factory=dict)


class RequestsFailedError(ValueError):
    """Packing a step's inputs failed because of some requests alone (each fails when packed
    by itself); the step can run without them.

    A `ValueError` whose message quotes each request's own error, so a caller of the runner
    alone sees what was wrong (the engine fails just those requests instead).

    Attributes:
        errors: The failing requests' scheduler ids and what each raised.
    """

    def __init__(self, errors: dict[str, Exception]) -> None:
        reasons = "; ".join(f"{request_id}: {error}" for request_id, error
                            in sorted(errors.items()))
        super().__init__(f"packing the step failed for requests {sorted(errors)} ({reasons})")
        self.errors = errors
