"""Speculative decoding on the host: a request's draft for one step, and acceptance counters.

A proposer (`jaxinfer.engine.spec.proposer.Proposer`) returns a `Draft` per request; the
scheduler takes them as `Scheduler.schedule(drafts)`, budgets them and feeds them to the step,
which verifies them. `SpecStats` counts the outcome, per request and for the whole engine.
Pure Python and numpy, like the rest of `jaxinfer.engine.host`.

Shape letters as in `jaxinfer/typing.py` (R: draft tokens of a request, V: vocab).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np


class Draft(NamedTuple):
    """The tokens proposed to follow a request's known tokens in the coming step.

    Attributes:
        token_ids: The draft tokens, in order (the step verifies a prefix the budget allows).
        probs: `[R, V]` the drafter's distribution each token was drawn from, or None for
            point-mass drafts (prompt lookup).
    """

    token_ids: list[int]
    probs: np.ndarray | None = None  # [R, V]


@dataclasses.dataclass
class SpecStats:
    """Speculative-decoding counters (of one request, or of the whole engine).

    Attributes:
        num_spec_steps: Target request-steps that verified drafts.
        num_draft_tokens: Draft tokens verified.
        num_accepted_tokens: Of those, the accepted ones.
        accepted_per_position: Accepted drafts at each draft position (0 = the first draft
            token): acceptance stops at the first rejection, so position i counts the
            verification steps that accepted more than i drafts.
    """

    num_spec_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)

    def add(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Counts one verification step (nothing if it had no drafts)."""
        if num_draft_tokens:
            self.num_spec_steps += 1
            self.num_draft_tokens += num_draft_tokens
            self.num_accepted_tokens += num_accepted_tokens
            positions = self.accepted_per_position
            positions.extend([0] * (num_draft_tokens - len(positions)))
            for position in range(num_accepted_tokens):
                positions[position] += 1

    def copy(self) -> SpecStats:
        """An independent copy."""
        return dataclasses.replace(self, accepted_per_position=list(self.accepted_per_position))

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over drafted tokens (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Accepted drafts per verification step (0 before any); each such step emits this
        plus one token."""
        return self.num_accepted_tokens / self.num_spec_steps if self.num_spec_steps else 0.0
