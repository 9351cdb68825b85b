"""When drafts pay: the step-cost fit, the batch's draft plan, and the controller that applies both."""

from __future__ import annotations

import itertools

import pytest

from metalserve.spec_decode.backoff import FIRST_COOLDOWN, BackOff
from metalserve.spec_decode.controller import PROBE_EVERY, DraftController
from metalserve.spec_decode.cost import StepCostModel, plan_drafts


def test_the_fit_recovers_a_linear_step_cost_and_ignores_a_pause() -> None:
    model = StepCostModel()
    assert model.fit() is None  # nothing known yet
    for t in (1, 8, 16, 40, 8, 1, 24, 5, 8, 40, 3, 12):
        model.record(t, 0.03 + 0.01 * t)
    model.record(8, 2.0)  # a collection pause or a compile: far off the line
    for t in (2, 6, 9):
        model.record(t, 0.03 + 0.01 * t)
    a, b = model.fit()  # type: ignore[misc]
    assert a == pytest.approx(0.03) and b == pytest.approx(0.01)


def test_steps_of_one_size_tell_nothing_but_a_fit_outlives_them() -> None:
    model = StepCostModel()
    for _ in range(20):
        model.record(8, 0.052)
    assert model.fit() is None
    for t in range(1, 9):
        model.record(t, 0.02 + 0.004 * t)
    assert model.fit() == pytest.approx((0.02, 0.004))
    for _ in range(100):  # drafting stopped: every step has the batch's size
        model.record(8, 0.052)
    assert model.fit() == pytest.approx((0.02, 0.004))


def expected_rate(
    plan: dict[str, int], acceptance: dict[str, float], a: float, b: float, base: int, depth_cost: float = 0.0
) -> float:
    """Expected output tokens per second of a step under `plan` (draft j kept with chance p ** j)."""
    tokens = base + sum(plan.values())
    outputs = sum(1 + sum(acceptance[r] ** j for j in range(1, n + 1)) for r, n in plan.items())
    return outputs / (a + b * tokens + depth_cost * max(plan.values(), default=0))


def test_without_a_fit_every_request_drafts_k() -> None:
    assert plan_drafts({"a": 0.1, "b": 0.9}, 4, None, 2) == {"a": 4, "b": 4}


def test_one_request_drafts_deep_where_the_step_is_bound_by_reading_weights() -> None:
    # This machine's numbers at concurrency 1 (bench/spec_decode.py): a = 15 ms, b = 3 ms a token.
    assert plan_drafts({"r": 0.9}, 4, (0.015, 0.003), 1) == {"r": 4}
    assert plan_drafts({"r": 0.05}, 4, (0.015, 0.003), 1) == {"r": 0}  # 5 % never pays for 3 ms


def test_a_compute_bound_batch_drafts_little_and_the_plan_beats_every_uniform_depth() -> None:
    fit, base = (0.026, 0.0036), 8  # eight requests: 8 tokens cost 55 ms, each more 3.6 ms
    acceptance = {f"r{i}": 0.8 for i in range(8)}
    plan = plan_drafts(acceptance, 4, fit, base)
    assert set(plan.values()) <= {1, 2}
    best = expected_rate(plan, acceptance, *fit, base)
    for depth in range(5):
        assert best >= expected_rate(dict.fromkeys(acceptance, depth), acceptance, *fit, base) - 1e-9
    low = {f"r{i}": 0.4 for i in range(8)}
    assert plan_drafts(low, 4, fit, base) == dict.fromkeys(low, 0)  # 40 % does not pay here


def test_mixed_acceptance_gives_the_likelier_requests_more_drafts() -> None:
    acceptance = {"good": 0.95, "fair": 0.6, "poor": 0.1}
    fit, base = (0.02, 0.003), 3
    plan = plan_drafts(acceptance, 6, fit, base)
    assert plan["good"] > plan["fair"] > plan["poor"] == 0
    best = expected_rate(plan, acceptance, *fit, base)
    for depths in itertools.product(range(7), repeat=3):  # greedy is as good as the best of all plans
        other = dict(zip(acceptance, depths, strict=True))
        assert best >= expected_rate(other, acceptance, *fit, base) - 1e-9


def test_acceptance_is_per_token_among_the_drafts_tested() -> None:
    b = BackOff()
    assert b.acceptance("r") == 1.0
    b.record("r", 4, 4)  # all four accepted: 1.0
    assert b.acceptance("r") == 1.0
    b.record("r", 4, 1)  # one accepted, the second refused: 1 / 2
    assert b.acceptance("r") == pytest.approx(0.65 * 1.0 + 0.35 * 0.5)


def test_the_controller_plans_from_acceptance_and_leaves_paused_requests_out() -> None:
    control = DraftController()
    for t in range(1, 13):
        control.record_step(t, 0.015 + 0.003 * t)
    for _ in range(3):
        control.record_window("good", 4, 4)
        control.record_window("bad", 4, 0)  # under 30 %: paused for a while
    limits = control.limits(["good", "bad", "new"], 3, 4)
    assert limits.keys() == {"good", "new"} and limits["good"] == 4
    assert 1 <= limits["new"] <= 4  # a new request starts from all requests' acceptance
    for _ in range(FIRST_COOLDOWN * 4):
        control.limits(["bad"], 1, 4)
    assert "bad" in control.limits(["bad"], 1, 4)
    control.forget("good")
    assert control.backoff.acceptance("good") == control.backoff.prior  # forgotten: a new request again


def test_a_new_request_starts_from_the_acceptance_of_all_requests() -> None:
    b = BackOff()
    assert b.acceptance("new") == 1.0  # nothing seen yet: optimistic
    for i in range(60):
        b.record(f"chat{i}", 4, 0)  # random chat: every draft fails
    assert b.acceptance("new") < 0.1


def test_a_request_planned_no_drafts_probes_with_one_now_and_then() -> None:
    control = DraftController()
    for t in range(1, 13):  # eight requests' steps, compute-bound: 3.6 ms a token
        control.record_step(8 + t, 0.026 + 0.0036 * (8 + t))
    for i in range(60):
        control.record_window(f"old{i}", 4, 0)  # the prior is near 0: drafts do not pay
    batch = [f"r{i}" for i in range(8)]
    plans = [control.limits(batch, 8, 4) for _ in range(2 * PROBE_EVERY)]
    drafted = [p for p in plans if any(p.values())]
    assert len(drafted) == 2 and all(set(p.values()) == {1} for p in drafted)


def test_a_draft_model_as_slow_as_the_target_is_not_worth_running_and_a_small_one_is() -> None:
    fit = (0.015, 0.003)
    assert plan_drafts({"r": 1.0}, 4, fit, 1, depth_cost=0.017) == {"r": 0}  # the target drafting itself
    assert plan_drafts({"r": 0.9}, 4, fit, 1, depth_cost=0.0017) == {"r": 4}  # a tenth of its size


def test_with_a_depth_cost_the_plan_is_as_good_as_the_best_of_all_plans() -> None:
    acceptance = {"good": 0.9, "fair": 0.7, "poor": 0.3}
    fit, base, depth_cost = (0.02, 0.003), 3, 0.004
    plan = plan_drafts(acceptance, 5, fit, base, depth_cost)
    best = expected_rate(plan, acceptance, *fit, base, depth_cost)
    for depths in itertools.product(range(6), repeat=3):
        other = dict(zip(acceptance, depths, strict=True))
        assert best >= expected_rate(other, acceptance, *fit, base, depth_cost) - 1e-9


def test_the_controller_learns_what_a_draft_position_costs() -> None:
    control = DraftController()
    for t in range(1, 13):
        control.record_step(t, 0.015 + 0.003 * t)
    assert control.limits(["r"], 1, 4) == {"r": 4}
    for _ in range(30):
        control.record_proposal(4, 0.068)  # 17 ms a position: as slow as the target
    assert control.depth_cost == pytest.approx(0.017, rel=1e-2)
    assert control.limits(["r"], 1, 4) == {"r": 0}
    control.record_proposal(0, 5.0)  # nothing drafted: says nothing of the cost
    assert control.depth_cost == pytest.approx(0.017, rel=1e-2)
    # Not even a probe: a sure draft costs 3 + 17 ms against 18 ms a token without it.
    assert not any(any(control.limits(["r"], 1, 4).values()) for _ in range(3 * PROBE_EVERY))
