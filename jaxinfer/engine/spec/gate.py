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
  its rate beats off's by more than `TIE_MARGIN` plus `NOISE_SIGMAS` standard errors of the
  difference (from the regime's measured window-to-window noise and the effective number of
  windows behind each rate): within noise, plain decoding is the safe choice. After `period`
  windows of the better mode it runs one window of the worse one to re-check it (a re-check
  of on that looks better but not surely runs up to `MIN_WINDOWS` windows); `period` is at
  least `gap / explore_fraction` (gap: the better rate over the
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
# Speculation must beat plain decoding by more than this fraction to be chosen...
TIE_MARGIN = 0.03
# ... and by more than this many standard errors of the difference on top (the window-to-window
# noise of a shared machine would otherwise pick speculation for a lucky window or two).
NOISE_SIGMAS = 1.0
# The relative window-to-window noise of a rate assumed before any is measured, the weight
# (in windows) of that assumption, and the weight of the past in the measured noise per window.
NOISE_PRIOR = 0.05
NOISE_PRIOR_WINDOWS = 2.0
NOISE_DECAY = 0.95
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
    # Per mode, decayed [tokens, seconds, window weight, squared window weight] over its
    # windows, and its window count.
    sums: dict[bool, list[float]] = dataclasses.field(
        default_factory=lambda: {False: [0.0, 0.0, 0.0, 0.0], True: [0.0, 0.0, 0.0, 0.0]})
    # Decayed sum of squared relative deviations of window rates from their mode's rate, and
    # its weight: the regime's window-to-window noise.
    noise: list[float] = dataclasses.field(
        default_factory=lambda: [NOISE_PRIOR ** 2 * NOISE_PRIOR_WINDOWS, NOISE_PRIOR_WINDOWS])
    windows: dict[bool, int] = dataclasses.field(
        default_factory=lambda: {False: 0, True: 0})
    best: bool | None = None  # None while exploring
    since_check: int = 0  # windows of the best mode since the last re-check or switch
    confirmations: int = 0  # consecutive re-checks that kept the choice
    rechecking: int = 0  # windows the current re-check of the worse mode has run

    def rate(self, mode: bool) -> float | None:
        """The mode's measured tokens per second (None before a window with time in it)."""
        tokens, seconds = self.sums[mode][:2]
        return tokens / seconds if seconds > 0 else None

    def windows_worth(self, mode: bool) -> float:
        """The effective number of windows behind the mode's rate (decayed weights)."""
        weight, squared = self.sums[mode][2:]
        return weight * weight / squared if squared > 0 else 0.0

    def speculation_wins(self) -> bool:
        """Whether on beats off by the tie margin plus `NOISE_SIGMAS` standard errors."""
        on, off = self.rate(True), self.rate(False)
        if on is None or off is None:
            return False
        noise = math.sqrt(self.noise[0] / self.noise[1])  # relative, per window
        error = noise * math.sqrt(on * on / self.windows_worth(True)
                                  + off * off / self.windows_worth(False))
        return on - (1.0 + TIE_MARGIN) * off > NOISE_SIGMAS * error


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
        window_rate = state.window_tokens / state.window_seconds
        before = state.rate(mode)
        if before is not None and state.windows_worth(mode) >= 1.0:
            deviation = (window_rate - before) / before
            state.noise = [NOISE_DECAY * state.noise[0] + deviation * deviation,
                           NOISE_DECAY * state.noise[1] + 1.0]
        for sums in state.sums.values():  # by age: a re-check outweighs a stale history
            sums[0] *= RATE_DECAY
            sums[1] *= RATE_DECAY
            sums[2] *= RATE_DECAY
            sums[3] *= RATE_DECAY * RATE_DECAY
        sums = state.sums[mode]
        sums[0] += state.window_tokens
        sums[1] += state.window_seconds
        sums[2] += 1.0
        sums[3] += 1.0
        state.windows[mode] += 1
        state.window_steps, state.window_tokens, state.window_seconds = 0, 0.0, 0.0
        on, off = state.rate(True), state.rate(False)
        if min(state.windows.values()) < MIN_WINDOWS or on is None or off is None:
            state.mode = not mode  # exploring: alternate
            return
        best = state.speculation_wins()
        if (state.rechecking and mode and not best and on > (1.0 + TIE_MARGIN) * off
                and state.rechecking < MIN_WINDOWS):
            state.rechecking += 1  # on looks better, not yet surely: re-check it once more
            self.stats.num_rechecks += 1
            return
        if state.rechecking or best != state.best:
            if state.best is not None and best != state.best:
                self.stats.num_switches += 1
            state.confirmations = (state.confirmations + 1
                                   if state.rechecking and best == state.best else 0)
            state.since_check = 0
            state.rechecking = 0
        else:
            state.since_check += 1
        state.best = best
        if state.since_check >= self.recheck_period(on, off, state.confirmations):
            state.mode, state.rechecking = not best, 1
            self.stats.num_rechecks += 1
        else:
            state.mode = best
