"""Speculative decoding options and the prompt-lookup (n-gram) proposer; host side, no jax.

    engine = Engine(model, EngineConfig(speculative={"method": "ngram", "num_tokens": 4,
                                                     "max_ngram": 3}))
    engine = Engine(model, EngineConfig(speculative={"method": "draft_model", "num_tokens": 4,
                                                     "model": "builtin:demo-draft"}))

Prompt lookup (METHODS.md section 5) matches the last n tokens of a request (n = max_ngram
down to min_ngram) against its earlier prompt and output tokens and proposes the k tokens that
followed the match. It costs no model pass and shines on input-grounded text (summaries,
copies, code edits). The drafts are verified as a point-mass drafter, so sampling stays exact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxinfer.engine.host.draft import Draft
from jaxinfer.engine.host.request import Request

METHODS = ("ngram", "draft_model")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """How the engine drafts tokens.

    Attributes:
        method: "ngram" (prompt lookup) or "draft_model".
        num_tokens: k, the most draft tokens verified per request and step.
        max_ngram: Longest suffix prompt lookup tries to match.
        min_ngram: Shortest suffix it tries before giving up (no drafts that step).
        model: The drafter for "draft_model" (anything `load_model` takes, e.g.
            "builtin:demo-draft"); it must share the target's tokenizer.
    """

    method: str
    num_tokens: int
    max_ngram: int = 3
    min_ngram: int = 1
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method = {self.method!r}: must be one of {METHODS}")
        for name in ("num_tokens", "max_ngram", "min_ngram"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative {name} = {value!r}: must be a positive integer")
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"speculative min_ngram = {self.min_ngram} exceeds max_ngram = "
                             f"{self.max_ngram}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative 'model' is required for method 'draft_model' and "
                             f"only allowed there; got method {self.method!r}, model "
                             f"{self.model!r}")

    @classmethod
    def parse(cls, options: SpeculativeConfig | Mapping[str, Any] | None
              ) -> SpeculativeConfig | None:
        """Accepts a config, a dict of its fields (the engine option's form) or None.

        Raises:
            ValueError: An unknown key or a bad value.
        """
        if options is None or isinstance(options, SpeculativeConfig):
            return options
        fields = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(options) - fields)
        if unknown:
            raise ValueError(f"unknown speculative options {unknown}; valid: {sorted(fields)}")
        return cls(**options)


def propose_ngram(token_ids: Sequence[int], num_tokens: int, max_ngram: int,
                  min_ngram: int = 1) -> list[int]:
    """Prompt lookup: the tokens that followed the latest earlier match of the longest suffix.

    For n = max_ngram down to min_ngram, the last n tokens are searched for among the earlier
    tokens; at the most recent earlier occurrence (the nearest context is the likeliest to
    continue alike), up to `num_tokens` tokens that followed it are proposed.

    Args:
        token_ids: The request's prompt and outputs so far.
        num_tokens: k, the most tokens to propose.
        max_ngram: Longest suffix to match.
        min_ngram: Shortest suffix to match.

    Returns:
        Up to k tokens; empty when no suffix of length >= min_ngram occurs earlier.
    """
    tokens = np.asarray(token_ids, np.int64)  # [L]
    length = len(tokens)
    for size in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = tokens[length - size:]  # [n]
        # Windows starting at 0 .. length - size - 1: every earlier occurrence.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:length - 1], size)  # [W, n]
        matches = np.flatnonzero(np.all(windows == suffix, axis=1))  # [M]
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

    def propose(self, requests: Sequence[Request]) -> dict[str, Draft]:
        """The tokens that followed the latest earlier match of each request's suffix (no
        entry for a request without a match)."""
        config = self.config
        drafts = {}
        for request in requests:
            tokens = propose_ngram(request.all_token_ids, config.num_tokens, config.max_ngram,
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
