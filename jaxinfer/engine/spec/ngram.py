"""The prompt-lookup (n-gram) proposer; host side, no jax.

    engine = load_engine(model, speculative={"method": "ngram", "num_tokens": 4,
                                             "max_ngram": 3})

(the options are `jaxinfer.engine.config.SpeculativeConfig`).

Prompt lookup (METHODS.md section 5) matches the last n tokens of a request (n = max_ngram
down to min_ngram) against its earlier prompt and output tokens and proposes the R tokens that
followed the match. It costs no model pass and shines on input-grounded text (summaries,
copies, code edits). The drafts are verified as a point-mass drafter, so sampling stays exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from jaxinfer.engine.config import SpeculativeConfig
from jaxinfer.engine.host.draft import Draft
from jaxinfer.engine.host.request import Request


def propose_ngram(token_ids: Sequence[int], num_tokens: int, max_ngram: int,
                  min_ngram: int = 1) -> list[int]:
    """Prompt lookup: the tokens that followed the latest earlier match of the longest suffix.

    For n = max_ngram down to min_ngram, the last n tokens are searched for among the earlier
    tokens; at the most recent earlier occurrence (the nearest context is the likeliest to
    continue alike), up to `num_tokens` tokens that followed it are proposed.

    Args:
        token_ids: The request's prompt and outputs so far.
        num_tokens: R, the most tokens to propose.
        max_ngram: Longest suffix to match.
        min_ngram: Shortest suffix to match.

    Returns:
        Up to R tokens; empty when no suffix of length >= min_ngram occurs earlier.
    """
    tokens = np.asarray(token_ids, np.int64)  # [len(token_ids)]
    length = len(tokens)
    for size in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = tokens[length - size:]  # [size]
        # Windows starting at 0 .. length - size - 1: every earlier occurrence.
        windows = np.lib.stride_tricks.sliding_window_view(
            tokens[:length - 1], size)  # [length - size, size]
        matches = np.flatnonzero(np.all(windows == suffix, axis=1))  # [num_matches]
        if len(matches):
            start = int(matches[-1]) + size
            return tokens[start:start + num_tokens].tolist()
    return []


class NgramProposer:
    """Prompt lookup as a `jaxinfer.engine.spec.proposer.Proposer`: point-mass drafts, no
    model, nothing held per request.

    Args:
        config: num_tokens (R), max_ngram and min_ngram are used.
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, requests: Sequence[Request],
                num_tokens: Mapping[str, int] | None = None) -> dict[str, Draft]:
        """The tokens that followed the latest earlier match of each request's suffix (no
        entry for a request without a match), at most `num_tokens[id]` (default R) each."""
        config = self.config
        drafts = {}
        for request in requests:
            limit = config.num_tokens if num_tokens is None else min(
                config.num_tokens, num_tokens.get(request.request_id, config.num_tokens))
            tokens = propose_ngram(request.all_token_ids, limit, config.max_ngram,
                                   config.min_ngram)
            if tokens:
                drafts[request.request_id] = Draft(tokens)
        return drafts

    def release(self, request_ids: Iterable[str]) -> None:
        """Nothing to free: prompt lookup keeps no state per request."""

    def warm_up(self) -> float:
        """Nothing to compile."""
        return 0.0

    @property
    def compilations(self) -> int:
        """No device programs."""
        return 0
