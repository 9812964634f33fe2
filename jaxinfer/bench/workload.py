"""Benchmark requests: N prompts of random token ids with given or random lengths, seeded.

Both benchmarks (`jaxinfer bench throughput`, `jaxinfer bench latency`) and both peers (the
jaxinfer engine and Hugging Face `generate`) take the same `BenchRequest` list, so every number
in a report is measured on identical work. Token ids are drawn from `[3, vocab)`, leaving out
the ids Llama-family vocabularies reserve for padding/unknown, BOS and EOS (0, 1, 2), so no
prompt carries a control token by accident.

    requests = make_requests(64, vocab_size=8192, input_len=(64, 256), output_len=128, seed=0)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

# Ids below this are control tokens in Llama-family vocabularies (pad/unk, BOS, EOS).
FIRST_ORDINARY_TOKEN = 3

# A length is one number (every request the same) or an inclusive (low, high) range.
LengthSpec = int | tuple[int, int]


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    """One benchmark request.

    Attributes:
        request_id: Unique within a workload.
        prompt_token_ids: The prompt.
        output_len: Exactly how many tokens to generate (stop tokens are ignored).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_len: int

    @property
    def prompt_len(self) -> int:
        """Number of prompt tokens."""
        return len(self.prompt_token_ids)


def parse_length(text: str) -> LengthSpec:
    """Parses a command-line length: `128` or an inclusive range `64,256`.

    Raises:
        ValueError: Not one or two positive integers, or a range whose low end exceeds its
            high end.
    """
    try:
        parts = [int(part) for part in text.replace(" ", "").split(",")]
    except ValueError:
        raise ValueError(f"length {text!r}: expected N or LOW,HIGH (positive integers)") from None
    if len(parts) not in (1, 2) or min(parts) < 1:
        raise ValueError(f"length {text!r}: expected N or LOW,HIGH (positive integers)")
    if len(parts) == 1:
        return parts[0]
    low, high = parts
    if low > high:
        raise ValueError(f"length {text!r}: the low end {low} exceeds the high end {high}")
    return low, high


def length_bounds(spec: LengthSpec) -> tuple[int, int]:
    """The smallest and largest length `spec` allows."""
    return (spec, spec) if isinstance(spec, int) else spec


def _draw_lengths(spec: LengthSpec, count: int, rng: np.random.Generator) -> np.ndarray:
    low, high = length_bounds(spec)
    return rng.integers(low, high + 1, size=count)  # [count]


def make_requests(num_requests: int, *, vocab_size: int, input_len: LengthSpec,
                  output_len: LengthSpec, seed: int = 0,
                  prefix: str = "bench") -> list[BenchRequest]:
    """Builds `num_requests` requests with prompts of random ordinary token ids.

    Args:
        num_requests: How many requests (N).
        vocab_size: The model's vocabulary size (V); token ids are drawn from [3, V).
        input_len: Prompt length, or an inclusive range to draw each prompt's length from.
        output_len: Output length, or an inclusive range to draw each request's from.
        seed: Seeds lengths and token ids; the same arguments give the same workload.
        prefix: Request ids are `f"{prefix}-{index}"`.

    Returns:
        The requests, in submission order.

    Raises:
        ValueError: A non-positive count or length, or a vocabulary with no ordinary ids.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests = {num_requests}: must be >= 1")
    if vocab_size <= FIRST_ORDINARY_TOKEN:
        raise ValueError(f"vocab_size = {vocab_size}: must exceed {FIRST_ORDINARY_TOKEN}")
    for name, spec in (("input_len", input_len), ("output_len", output_len)):
        low, high = length_bounds(spec)
        if low < 1 or low > high:
            raise ValueError(f"{name} = {spec!r}: need 1 <= low <= high")
    rng = np.random.default_rng(seed)
    prompt_lens = _draw_lengths(input_len, num_requests, rng)  # [num_requests]
    output_lens = _draw_lengths(output_len, num_requests, rng)  # [num_requests]
    requests = []
    for index in range(num_requests):
        prompt = rng.integers(FIRST_ORDINARY_TOKEN, vocab_size,
                              size=int(prompt_lens[index]))  # [prompt_len]
        requests.append(BenchRequest(f"{prefix}-{index}", tuple(int(t) for t in prompt),
                                     int(output_lens[index])))
    return requests


def total_prompt_tokens(requests: Sequence[BenchRequest]) -> int:
    """Sum of the prompt lengths."""
    return sum(request.prompt_len for request in requests)


def total_output_tokens(requests: Sequence[BenchRequest]) -> int:
    """Sum of the output lengths (what a correct run generates)."""
    return sum(request.output_len for request in requests)


def max_sequence_len(requests: Sequence[BenchRequest]) -> int:
    """The longest prompt plus its output: the context the engine must hold."""
    return max(request.prompt_len + request.output_len for request in requests)


def with_output_len(requests: Sequence[BenchRequest], output_len: int) -> list[BenchRequest]:
    """The same prompts and ids with every output length set to `output_len`."""
    return [dataclasses.replace(request, output_len=output_len) for request in requests]
