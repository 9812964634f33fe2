"""The speculation controller with made-up costs and acceptances: low acceptance turns
speculation off, drafts that would cross into a costlier bucket are dropped, high acceptance at
batch 1 keeps all R drafts, a turned-off request is probed again within its allowance, and the
cost model prices what it has not measured pessimistically."""

from __future__ import annotations

import pytest

from jaxinfer.engine.config import SpeculativeConfig
from jaxinfer.engine.spec.controller import (
    PROBE_AFTER_STEPS,
    SpecController,
    StepCosts,
    expected_tokens,
)

R = 4
BUCKETS = (8, 16, 32, 64, 128)
SEQUENCE_BUCKETS = (1, 2, 4, 8)


def _controller(costs: dict[tuple[int, bool], float] | None = None,
                probe_fraction: float = 0.0) -> SpecController:
    controller = SpecController(R, BUCKETS, SEQUENCE_BUCKETS, probe_fraction)
    controller.bootstrap(costs if costs is not None else {
        (8, False): 0.010, (8, True): 0.011, (16, False): 0.020, (16, True): 0.022,
        (32, False): 0.030, (32, True): 0.033, (64, False): 0.050, (64, True): 0.055,
        (128, False): 0.090, (128, True): 0.099})
    return controller


def _verify(controller: SpecController, request_id: str, accepted: int, times: int = 20,
            drafted: int = R) -> None:
    for _ in range(times):
        controller.observe_verification(request_id, drafted, accepted)


def _plan_decoding(controller: SpecController, request_ids: list[str]) -> dict[str, int]:
    """Plans a step of decoding requests only (one token each), each with room for R."""
    return controller.plan({request_id: R for request_id in request_ids},
                           num_tokens=len(request_ids), num_emitting=len(request_ids),
                           max_drafts=BUCKETS[-1] - len(request_ids))


@pytest.mark.parametrize("acceptance", [0.0, 0.3, 0.8, 0.99])
def test_expected_tokens_is_the_geometric_sum(acceptance):
    for k in range(6):
        assert expected_tokens(acceptance, k) == pytest.approx(
            (1 - acceptance ** (k + 1)) / (1 - acceptance))
    assert expected_tokens(1.0, 3) == 4


def test_high_acceptance_at_batch_1_keeps_every_draft():
    controller = _controller()
    _verify(controller, "a", accepted=R)
    assert controller.acceptance("a") > 0.95
    assert _plan_decoding(controller, ["a"]) == {"a": R}
    assert controller.stats.mean_drafts == R


def test_low_acceptance_turns_speculation_off():
    controller = _controller()
    _verify(controller, "a", accepted=0)
    assert controller.acceptance("a") < 0.05
    assert _plan_decoding(controller, ["a"]) == {}
    # The same slack at a middling rate buys a shorter draft: its 4th draft is worth 0.3^4.
    controller = _controller()
    controller.bootstrap({})
    _verify(controller, "b", accepted=1, drafted=2)  # one of two accepted: rate 0.5
    plan = _plan_decoding(controller, ["b"])
    assert plan == {"b": R}  # drafts in the slack of bucket 8 cost only the verification


def test_drafts_that_cross_into_a_costlier_bucket_are_dropped():
    # 8 decoding requests fill bucket 8; any draft moves the step to bucket 16 (2x).
    requests = [str(index) for index in range(8)]
    controller = _controller()
    for request_id in requests:
        _verify(controller, request_id, accepted=1, drafted=2)  # rate ~0.5
    assert _plan_decoding(controller, requests) == {}
    # Where the bigger bucket costs little more, the same acceptance pays for drafts.
    cheap = _controller({(8, False): 0.010, (8, True): 0.011, (16, True): 0.012,
                         (32, True): 0.013, (64, True): 0.050, (128, True): 0.090})
    for request_id in requests:
        _verify(cheap, request_id, accepted=1, drafted=2)
    plan = _plan_decoding(cheap, requests)
    assert set(plan) == set(requests)
    assert 8 + sum(plan.values()) <= 32  # never into the expensive 64-token bucket


def test_the_best_requests_get_the_drafts_when_few_fit():
    # Bucket 16 costs 1.2x bucket 8: only drafts worth more than that are bought.
    controller = _controller({(8, False): 0.010, (8, True): 0.010, (16, True): 0.012,
                              (32, True): 0.030})
    good, poor = [f"good{index}" for index in range(4)], [f"poor{index}" for index in range(4)]
    for request_id in good:
        _verify(controller, request_id, accepted=R)
    for request_id in poor:
        _verify(controller, request_id, accepted=0)
    plan = _plan_decoding(controller, good + poor)
    assert plan and set(plan) <= set(good)
    assert sum(plan.values()) == 8  # fills bucket 16 exactly: 8 tokens + 8 drafts


def test_a_costly_drafter_turns_speculation_off():
    controller = _controller()
    _verify(controller, "a", accepted=1, drafted=2)  # rate ~0.5: E(4) ~ 1.9
    controller.observe_drafts(1, R, 0.030)  # drafting costs 3 plain steps
    assert _plan_decoding(controller, ["a"]) == {}
    controller.observe_drafts(1, 1, 0.001)  # one draft needs no decode loop: cheap
    assert _plan_decoding(controller, ["a"]) == {"a": 1}


def test_new_requests_start_from_the_engines_prior():
    controller = _controller()
    for request_id in ("a", "b", "c"):
        _verify(controller, request_id, accepted=0)
    assert controller.acceptance("new") < 0.2
    assert _plan_decoding(controller, ["new"]) == {}
    controller.release(["a", "b", "c"])
    assert controller.acceptance("a") == controller.acceptance("new")  # forgotten


def test_a_turned_off_request_is_probed_within_its_allowance():
    controller = _controller(probe_fraction=0.05)
    _verify(controller, "a", accepted=0)
    grants = []
    for _ in range(2 * PROBE_AFTER_STEPS):
        grants.append(_plan_decoding(controller, ["a"]))
        controller.observe_step(1 + sum(grants[-1].values()), bool(grants[-1]),
                                0.011 if grants[-1] else 0.010, 0.0)
    probes = [step for step, grant in enumerate(grants) if grant]
    assert probes and probes[0] >= PROBE_AFTER_STEPS - 1
    assert all(grants[step] == {"a": 1} for step in probes)
    assert controller.stats.num_probes == len(probes) <= 2
    # An accepted probe lifts the estimate; without an allowance nothing is probed.
    assert _controller(probe_fraction=0.0).stats.num_probes == 0
    silent = _controller(probe_fraction=0.0)
    _verify(silent, "a", accepted=0)
    for _ in range(2 * PROBE_AFTER_STEPS):
        assert _plan_decoding(silent, ["a"]) == {}
        silent.observe_step(1, False, 0.010, 0.0)


def test_probes_never_cross_into_a_costlier_bucket_beyond_the_allowance():
    requests = [str(index) for index in range(8)]
    controller = _controller(probe_fraction=0.02)
    for request_id in requests:
        _verify(controller, request_id, accepted=0)
    crossed = 0
    for _ in range(4 * PROBE_AFTER_STEPS):
        plan = _plan_decoding(controller, requests)
        crossed += bool(plan)
        controller.observe_step(8 + sum(plan.values()), bool(plan),
                                0.022 if plan else 0.010, 0.0)
    # A crossing costs 0.012 s extra; 2% of ~64 steps of 0.010 s pays for one at most.
    assert crossed <= 1


def test_a_probe_that_costs_more_than_estimated_is_charged_to_the_allowance():
    controller = _controller(probe_fraction=0.05)
    _verify(controller, "a", accepted=0)
    probes = []
    for _ in range(4 * PROBE_AFTER_STEPS):
        grant = _plan_decoding(controller, ["a"])
        if grant:
            probes.append(grant)
            controller.observe_drafts(1, 1, 0.100)  # a drafter catching up: 10 steps' worth
        controller.observe_step(1 + sum(grant.values()), bool(grant),
                                0.011 if grant else 0.010, 0.0)
    assert len(probes) == 1  # 5% of 64 steps of 0.010 s does not repay 0.1 s


def test_first_real_steps_replace_warm_up_timings():
    controller = _controller()
    controller.observe_step(8, True, 0.030, 0.0)  # real context: dearer than padding
    assert controller.step_costs[False].seconds(8, True) == 0.030
    assert controller.step_costs[True].seconds(8, True) == 0.011  # sampled: not yet seen
    controller.observe_step(8, True, 0.040, 0.0)
    assert 0.030 < controller.step_costs[False].seconds(8, True) < 0.040


def test_nothing_is_drafted_before_any_cost_is_known():
    controller = SpecController(R, BUCKETS, SEQUENCE_BUCKETS)
    assert _plan_decoding(controller, ["a"]) == {}
    controller.observe_step(100, False, 0.09, 0.0)  # a prefill step in bucket 128
    assert _plan_decoding(controller, ["a"]) == {"a": R}  # bucket 8 priced as 128: pessimistic


def test_unmeasured_buckets_are_priced_pessimistically():
    costs = StepCosts(BUCKETS)
    assert costs.seconds(8, False) is None and not costs.measured
    costs.observe(5, False, 0.010)
    assert costs.seconds(8, False) == 0.010
    assert costs.seconds(16, False) == pytest.approx(0.020)  # linear from bucket 8
    assert costs.seconds(100, False) == pytest.approx(0.160)
    assert costs.seconds(256, False) == pytest.approx(0.320)  # past the budget: linear
    assert costs.seconds(8, True) == pytest.approx(0.0125)  # the verification guess
    costs.observe(8, True, 0.011)
    assert costs.seconds(8, True) == 0.011
    assert costs.seconds(16, True) == pytest.approx(0.022)  # the measured ratio 1.1
    costs.observe(8, False, 0.020)  # a decayed mean, not the latest value
    assert 0.010 < costs.seconds(8, False) < 0.020


def test_speculative_config_validates_the_controller_knobs():
    assert SpeculativeConfig(method="ngram", num_tokens=2).adaptive
    with pytest.raises(ValueError, match="adaptive"):
        SpeculativeConfig(method="ngram", num_tokens=2, adaptive="yes")
    for bad in (-0.1, 1.0, True, "0.1"):
        with pytest.raises(ValueError, match="probe_fraction"):
            SpeculativeConfig(method="ngram", num_tokens=2, probe_fraction=bad)
