"""The throughput gate with simulated step times: a regime where speculation is 2x slower
settles on plain decoding and re-checks within its budget, one where it is faster settles on
speculation, regimes learn apart, ties and near-ties go to plain decoding, and a mode that
stops paying is dropped within a few windows."""

from __future__ import annotations

import random

import pytest

from jaxinfer.engine.spec.gate import (
    MIN_WINDOWS,
    WINDOW_STEPS,
    ThroughputGate,
    regime_of,
)

BATCH_1 = regime_of(1, False)
BATCH_8 = regime_of(8, False)


def _simulate(gate: ThroughputGate, regime, steps: int, on_rate: float,
              off_rate: float = 100.0, tokens: int = 1) -> tuple[float, int, int]:
    """Runs `steps` steps of `regime`, each emitting `tokens` tokens (twice as many when on)
    at the given tokens per second. Returns (seconds, tokens emitted, on steps)."""
    seconds, emitted, on_steps = 0.0, 0, 0
    for _ in range(steps):
        on = gate.speculate(regime)
        count = 2 * tokens if on else tokens
        step_seconds = count / (on_rate if on else off_rate)
        gate.observe(regime, on, count, step_seconds)
        seconds += step_seconds
        emitted += count
        on_steps += on
    return seconds, emitted, on_steps


def test_regimes_bucket_batch_sizes_and_sampling():
    assert [regime_of(n, False)[0] for n in (0, 1, 2, 4, 5, 16, 17, 64)] == [
        1, 1, 2, 2, 5, 5, 17, 17]
    assert regime_of(3, True) == (2, True) != regime_of(3, False)


def test_exploration_alternates_windows_starting_with_plain_decoding():
    gate = ThroughputGate()
    modes = []
    for _ in range(2 * MIN_WINDOWS * WINDOW_STEPS):
        on = gate.speculate(BATCH_1)
        modes.append(on)
        # An unmeasured step (one that also prefills) follows the mode, advances nothing.
        assert gate.speculate(BATCH_1) == on
        gate.observe(BATCH_1, on, 1, 0.01)
    windows = [modes[index] for index in range(0, len(modes), WINDOW_STEPS)]
    assert windows == [False, True] * MIN_WINDOWS
    assert all(modes[index] == windows[index // WINDOW_STEPS] for index in range(len(modes)))
    assert gate.choice(BATCH_1) is not None


def test_speculation_twice_as_slow_settles_on_plain_within_the_explore_budget():
    gate = ThroughputGate(explore_fraction=0.02)
    steps = 1000 * WINDOW_STEPS
    seconds, emitted, on_steps = _simulate(gate, BATCH_1, steps, on_rate=50.0)
    assert gate.choice(BATCH_1) is False
    plain_seconds = emitted / 100.0  # the same tokens without speculation
    assert seconds / plain_seconds - 1 <= 0.03  # exploration included
    # Past the first exploration, re-checks stay within the 2% budget.
    explored = MIN_WINDOWS * WINDOW_STEPS
    assert (on_steps - explored) / steps <= 0.02 / 2  # an on step costs 2 plain steps here
    assert gate.stats.num_rechecks >= 2  # it does look again, less and less often
    more_seconds, more_emitted, _ = _simulate(gate, BATCH_1, steps, on_rate=50.0)
    assert more_seconds / (more_emitted / 100.0) - 1 <= 0.005


def test_faster_speculation_settles_on_speculation():
    gate = ThroughputGate()
    _, _, on_steps = _simulate(gate, BATCH_1, 200 * WINDOW_STEPS, on_rate=150.0)
    assert gate.choice(BATCH_1) is True
    assert on_steps / (200 * WINDOW_STEPS) > 0.9
    on_rate, off_rate = gate.rates(BATCH_1)
    assert on_rate == pytest.approx(150.0) and off_rate == pytest.approx(100.0)


@pytest.mark.parametrize("on_rate", [100.0, 102.0, 97.0])
def test_ties_and_near_ties_go_to_plain_decoding(on_rate):
    gate = ThroughputGate()
    _simulate(gate, BATCH_1, 100 * WINDOW_STEPS, on_rate=on_rate)
    assert gate.choice(BATCH_1) is False


def test_regimes_learn_independently():
    gate = ThroughputGate()
    sampled = regime_of(8, True)
    for _ in range(100):  # interleaved, a window's worth at a time
        _simulate(gate, BATCH_1, WINDOW_STEPS, on_rate=150.0)
        _simulate(gate, BATCH_8, 3, on_rate=40.0)
        _simulate(gate, sampled, 5, on_rate=60.0)
    assert gate.choice(BATCH_1) is True
    assert gate.choice(BATCH_8) is False
    assert gate.choice(sampled) is False
    assert gate.choice(regime_of(32, False)) is None  # never seen


@pytest.mark.parametrize(("before", "after", "windows", "on_windows"), [
    # Speculation that stops paying is dropped within a few windows.
    (200.0, 50.0, 50, (0, 3)),
    # A re-check brings speculation back when it starts paying.
    (50.0, 200.0, 200, (100, 200)),
])
def test_the_gate_follows_a_change_in_what_pays(before, after, windows, on_windows):
    gate = ThroughputGate()
    _simulate(gate, BATCH_1, 100 * WINDOW_STEPS, on_rate=before)
    assert gate.choice(BATCH_1) is (before > after)
    _, _, on_steps = _simulate(gate, BATCH_1, windows * WINDOW_STEPS, on_rate=after)
    assert gate.choice(BATCH_1) is (after > before)
    low, high = on_windows
    assert low * WINDOW_STEPS <= on_steps <= high * WINDOW_STEPS


def test_recheck_period_grows_with_the_gap_and_with_confirmations():
    gate = ThroughputGate(explore_fraction=0.02)
    assert gate.recheck_period(101.0, 100.0, 0) == 8  # the floor
    assert gate.recheck_period(50.0, 100.0, 0) == 50  # gap 1: 1 / 0.02
    assert gate.recheck_period(50.0, 100.0, 1) == 100
    assert gate.recheck_period(50.0, 100.0, 10) == 512  # the cap
    assert ThroughputGate(explore_fraction=0.0).recheck_period(50.0, 100.0, 0) == 512


def _simulate_noisy(gate: ThroughputGate, regime, steps: int, on_rate: float,
                    noise: float, seed: int) -> tuple[float, float]:
    """Like `_simulate`, each window's steps slowed or sped up together by up to `noise`
    (a shared machine's load changes over windows, not per token). Returns (seconds, the
    seconds the same tokens would take without speculation)."""
    rng = random.Random(seed)
    seconds = plain_seconds = 0.0
    for step in range(steps):
        if step % WINDOW_STEPS == 0:
            load = 1.0 + rng.uniform(-noise, noise)
        on = gate.speculate(regime)
        count = 2 if on else 1
        step_seconds = load * count / (on_rate if on else 100.0)
        gate.observe(regime, on, count, step_seconds)
        seconds += step_seconds
        plain_seconds += load * count / 100.0
    return seconds, plain_seconds


@pytest.mark.parametrize("seed", range(5))
def test_noise_alone_does_not_turn_speculation_on(seed):
    # Equal rates, +-20% window-to-window load: speculation must not win by luck for long.
    gate = ThroughputGate()
    seconds, plain_seconds = _simulate_noisy(gate, BATCH_1, 400 * WINDOW_STEPS, 100.0,
                                             noise=0.2, seed=seed)
    assert gate.stats.on_fraction < 0.15
    # And where speculation is 10% slower, the noise costs at most a few percent.
    gate = ThroughputGate()
    seconds, plain_seconds = _simulate_noisy(gate, BATCH_1, 400 * WINDOW_STEPS, 90.0,
                                             noise=0.2, seed=seed)
    assert seconds / plain_seconds - 1 < 0.02


@pytest.mark.parametrize("seed", range(5))
def test_clearly_faster_speculation_wins_through_noise(seed):
    gate = ThroughputGate()
    _simulate_noisy(gate, BATCH_1, 200 * WINDOW_STEPS, 150.0, noise=0.2, seed=seed)
    assert gate.choice(BATCH_1) is True
    assert gate.stats.on_fraction > 0.8
