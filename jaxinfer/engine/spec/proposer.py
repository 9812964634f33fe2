"""What the engine asks of a drafter: the `Proposer` protocol, and the factory that builds one.

Each step the engine hands the proposer its running requests that speculate and are decoding
(every known token but the last computed), takes back a `Draft` per request it proposes for,
and gives them to `Scheduler.schedule(drafts)`; the runner verifies them. A proposer never
writes to the scheduler's requests. Implementations: `jaxinfer.engine.spec.ngram.NgramProposer`
(prompt lookup, no model) and `jaxinfer.engine.spec.draft_model.DraftModelProposer` (a small
model with its own paged cache); tests plug in their own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol, runtime_checkable

from jaxinfer.engine.config import SpeculativeConfig
from jaxinfer.engine.device.runner import RunnerConfig
from jaxinfer.engine.host.draft import Draft
from jaxinfer.engine.host.request import Request
from jaxinfer.engine.spec.ngram import NgramProposer
from jaxinfer.model_loading import load_model
from jaxinfer.models import Transformer

__all__ = ["Draft", "Proposer", "build_proposer"]


@runtime_checkable
class Proposer(Protocol):
    """Drafts tokens for decoding requests, one step at a time."""

    def propose(self, requests: Sequence[Request],
                num_tokens: Mapping[str, int] | None = None) -> dict[str, Draft]:
        """Drafts for the coming step.

        Args:
            requests: Running, decoding, speculating requests (read only).
            num_tokens: The most drafts per request id (the speculation controller's grant,
                at most R); None: R for every request. The engine cuts longer drafts.

        Returns:
            A draft per request id it proposes for (at most `num_speculative_tokens` tokens,
            with `[R, V]` probabilities when the engine was built for draft distributions);
            requests left out get none this step.
        """
        ...

    def release(self, request_ids: Iterable[str]) -> None:
        """Forgets requests that finished or were aborted (frees what it holds for them)."""
        ...

    def warm_up(self) -> float:
        """Compiles whatever the proposer runs on device; returns seconds."""
        ...

    @property
    def compilations(self) -> int:
        """Programs compiled so far (constant after `warm_up`)."""
        ...


def build_proposer(config: SpeculativeConfig | None, target: Transformer,
                   runner_config: RunnerConfig, *,
                   draft_model: Transformer | None = None) -> Proposer | None:
    """The proposer a speculative config asks for, or None without one.

    Args:
        config: The engine's speculative options.
        target: The served model (the drafter must share its vocabulary).
        runner_config: The target runner's config (a draft model's runner reuses its sizes).
        draft_model: The drafter for method "draft_model", if already built; None loads
            `config.model`.

    Raises:
        ValueError: A drafter whose vocabulary differs from the target's.
    """
    if config is None:
        return None
    if config.method == "ngram":
        return NgramProposer(config)
    # Imported here: only a draft model needs the device-side drafter.
    from jaxinfer.engine.spec.draft_model import DraftModelProposer

    drafter = draft_model if draft_model is not None else load_model(config.model)
    if drafter.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"the drafter's vocabulary ({drafter.config.vocab_size}) differs "
                         f"from the target's ({target.config.vocab_size})")
    return DraftModelProposer(drafter, runner_config, config.num_tokens)
