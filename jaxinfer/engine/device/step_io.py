"""The device step's typed inputs and outputs, which are also the multi-host wire format.

`ModelRunner.prepare` packs the scheduled requests into a `StepInputs` of host (numpy)
arrays; `ModelRunner.run` feeds it to the jitted step, which returns a `StepOutputs` of
device arrays. A multi-host leader sends the same `StepInputs` down the step channel, so the
followers run the same program on the same values. Both are NamedTuples, so they are pytrees
(jit, `jax.tree.map` and `jax.device_get` walk them; a None field is an empty subtree) and
pickle by name.

Which program runs (the plain step or the one that also returns prompt logprobs) is a static
choice made beside the inputs, not a field: it selects a different compiled program.

Shapes use the project's one legend, `jaxinfer/typing.py`. Here T is the step's token bucket,
Q its sequence bucket (<= max_num_seqs), R the runner's `num_speculative_tokens` and M its
`max_logprobs`; a page table is `[Q, pages_per_sequence]` (the runner's page-table width).
"""

from __future__ import annotations

from typing import NamedTuple

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
