"""The throughput gate: speculate only where speculation has measurably beaten plain decoding.

The speculation controller (`jaxinfer.engine.spec.controller`) decides which requests draft
and how much from a cost model, and a cost model can be wrong (a drafter catching up on
tokens it skipped, sampled steps, a machine shared with other work). The gate sits above it
and relies on nothing but measured end-to-end throughput: output tokens per wall second of
whole engine steps (propose, schedule, execute, outputs), with speculation on (the
controller's grants) and off (no proposer call at all).

* Regimes. Throughput depends on the batch and on sampling, so the gate keeps one state per
  regime: the number of decoding requests, bucketed as 1 / 2-4 / 5-16 / 17+, and whether any
  running request samples. Regimes learn independently.
* Windows. A regime runs `WINDOW_STEPS` measured steps in one mode (a window), then folds
  the window's tokens and seconds into that mode's sums and picks the next window's mode. Both
  modes' sums decay by `RATE_DECAY` per window of the regime, so a rate reflects its mode's
  recent windows and a re-check is not outvoted by a stale history (rates are ratios of the
  sums, so decay alone leaves them as they are). Only steps in which every scheduled request
  decodes are measured; steps that also prefill follow the regime's current mode without
  counting.
* Explore, then exploit. A new regime alternates off and on windows (off first) until each
  mode has `MIN_WINDOWS`. Then it runs the better mode, where on counts as better only if
  its rate beats off's by more than `TIE_MARGIN` (within noise, plain decoding is the safe
  choice). After `period` windows of the better mode it runs one window of the worse one to
  re-check it; `period` is at least `gap / explore_fraction` (gap: the better rate over the
  worse, less one), so a re-check costs at most `explore_fraction` of the time, never fewer
  than `MIN_RECHECK_WINDOWS`, and doubles with each re-check that confirms the choice (up to
  `MAX_RECHECK_WINDOWS`). The better mode's own rate keeps updating, so a mode that stops
  paying (on: the text stopped being copyable) loses its place within a few windows; a
  re-check that finds the other mode better switches at once.

Turning speculation on after a stretch off costs a draft model a catch-up pass over the
tokens it skipped; that lands in the on window's measured time, as it does in real use.

Pure Python, no jax: the engine feeds it token counts and seconds.
"""

from __future__ import annotations

import bisect
import dataclasses
import math

# Measured steps per window.
WINDOW_STEPS = 8
# Windows of each mode a regime measures before it exploits.
MIN_WINDOWS = 3
# Weight of the past in each mode's token and second sums, per window of the regime (either
# mode), so a mode's history fades with its age and one re-check window mostly replaces it.
RATE_DECAY = 0.75
# Speculation must beat plain decoding by more than this fraction to be chosen.
TIE_MARGIN = 0.03
# Bounds on the windows of the better mode between two re-checks of the worse one.
MIN_RECHECK_WINDOWS = 8
MAX_RECHECK_WINDOWS = 512
# Upper bounds of the batch buckets (decoding requests); larger batches share the last regime.
BATCH_BUCKETS = (1, 4, 16)

Regime = tuple[int, bool]  # (smallest batch of the bucket, whether any request samples)


def regime_of(num_decoding: int, sampled: bool) -> Regime:
    """The regime of a step with `num_decoding` decoding requests (`sampled`: any samples)."""
    index = bisect.bisect_left(BATCH_BUCKETS, max(num_decoding, 1))
    return (1, *(bound + 1 for bound in BATCH_BUCKETS))[index], sampled


@dataclasses.dataclass
class _RegimeState:
    """One regime's measurements and choice."""

    mode: bool = False  # the current window's mode (True: speculate)
    window_steps: int = 0
    window_tokens: float = 0.0
    window_seconds: float = 0.0
    # Per mode, decayed [tokens, seconds] over its windows, and its window count.
    sums: dict[bool, list[float]] = dataclasses.field(
        default_factory=lambda: {False: [0.0, 0.0], True: [0.0, 0.0]})
    windows: dict[bool, int] = dataclasses.field(
        default_factory=lambda: {False: 0, True: 0})
    best: bool | None = None  # None while exploring
    since_check: int = 0  # windows of the best mode since the last re-check or switch
    confirmations: int = 0  # consecutive re-checks that kept the choice
    rechecking: bool = False  # the current window re-checks the worse mode

    def rate(self, mode: bool) -> float | None:
        """The mode's measured tokens per second (None before a window with time in it)."""
        tokens, seconds = self.sums[mode]
        return tokens / seconds if seconds > 0 else None


@dataclasses.dataclass
class GateStats:
    """What the gate decided, over all steps.

    Attributes:
        num_on_steps: Steps it let speculate.
        num_off_steps: Steps it kept plain.
        num_rechecks: Windows that re-checked the mode not chosen.
        num_switches: Times a regime's chosen mode changed after exploring.
    """

    num_on_steps: int = 0
    num_off_steps: int = 0
    num_rechecks: int = 0
    num_switches: int = 0

    @property
    def on_fraction(self) -> float:
        """Share of gated steps that speculated (0 before any)."""
        total = self.num_on_steps + self.num_off_steps
        return self.num_on_steps / total if total else 0.0


class ThroughputGate:
    """Per regime, whether steps speculate, from measured tokens per second on and off.

    Args:
        explore_fraction: The share of time re-checks of the worse mode may cost, once the
            initial exploration is over.

    Attributes:
        stats: What it decided so far.
    """

    def __init__(self, explore_fraction: float = 0.02) -> None:
        self.explore_fraction = explore_fraction
        self._regimes: dict[Regime, _RegimeState] = {}
        self.stats = GateStats()

    def speculate(self, regime: Regime) -> bool:
        """Whether the coming step of `regime` speculates (counted in `stats`)."""
        on = self._state(regime).mode
        if on:
            self.stats.num_on_steps += 1
        else:
            self.stats.num_off_steps += 1
        return on

    def observe(self, regime: Regime, speculated: bool, num_tokens: int,
                seconds: float) -> None:
        """Records a measured step of `regime`: `num_tokens` output tokens in `seconds` of
        whole-step wall time, run with speculation on or off as `speculate` said."""
        state = self._state(regime)
        if speculated != state.mode or seconds <= 0:
            return  # not this window's mode (cannot happen through the engine)
        state.window_steps += 1
        state.window_tokens += num_tokens
        state.window_seconds += seconds
        if state.window_steps >= WINDOW_STEPS:
            self._close_window(state)

    def choice(self, regime: Regime) -> bool | None:
        """The regime's chosen mode (None while it explores)."""
        state = self._regimes.get(regime)
        return None if state is None else state.best

    def rates(self, regime: Regime) -> tuple[float | None, float | None]:
        """The regime's measured (on, off) tokens per second."""
        state = self._state(regime)
        return state.rate(True), state.rate(False)

    def _state(self, regime: Regime) -> _RegimeState:
        state = self._regimes.get(regime)
        if state is None:
            state = self._regimes[regime] = _RegimeState()
        return state

    def recheck_period(self, on: float, off: float, confirmations: int) -> int:
        """Windows of the better mode before the worse one is re-checked."""
        gap = max(on, off) / min(on, off) - 1.0
        base = (max(MIN_RECHECK_WINDOWS, math.ceil(gap / self.explore_fraction))
                if self.explore_fraction > 0 else MAX_RECHECK_WINDOWS)
        return min(base * 2 ** min(confirmations, 16), MAX_RECHECK_WINDOWS)

    def _close_window(self, state: _RegimeState) -> None:
        """Folds the finished window into its mode's sums and picks the next window's mode."""
        mode = state.mode
        for sums in state.sums.values():  # by age: a re-check outweighs a stale history
            sums[0] *= RATE_DECAY
            sums[1] *= RATE_DECAY
        state.sums[mode][0] += state.window_tokens
        state.sums[mode][1] += state.window_seconds
        state.windows[mode] += 1
        state.window_steps, state.window_tokens, state.window_seconds = 0, 0.0, 0.0
        on, off = state.rate(True), state.rate(False)
        if min(state.windows.values()) < MIN_WINDOWS or on is None or off is None:
            state.mode = not mode  # exploring: alternate
            return
        best = on > (1.0 + TIE_MARGIN) * off
        if state.rechecking or best != state.best:
            if state.best is not None and best != state.best:
                self.stats.num_switches += 1
            state.confirmations = (state.confirmations + 1
                                   if state.rechecking and best == state.best else 0)
            state.since_check = 0
            state.rechecking = False
        else:
            state.since_check += 1
        state.best = best
        if state.since_check >= self.recheck_period(on, off, state.confirmations):
            state.mode, state.rechecking = not best, True
            self.stats.num_rechecks += 1
        else:
            state.mode = best
