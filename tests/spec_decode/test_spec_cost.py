"""When drafts pay: the step-cost fit and the draft positions it allows."""

from __future__ import annotations

import pytest

from metalserve.spec_decode.backoff import BackOff
from metalserve.spec_decode.cost import StepCostModel, drafts_worth


def test_the_fit_recovers_a_linear_step_cost() -> None:
    model = StepCostModel()
    assert model.threshold(8, 8) == 0.0  # nothing known yet: drafts are free
    for t in (1, 8, 16, 40, 8, 1, 24, 512, 8, 40):
        model.record(t, 0.03 + 0.01 * t)
    a, b = model.fit()  # type: ignore[misc]
    assert a == pytest.approx(0.03) and b == pytest.approx(0.01)
    assert model.threshold(1, 1) == pytest.approx(0.01 / 0.04)  # one request: a draft needs 25 %
    assert model.threshold(8, 8) == pytest.approx(0.08 / 0.11)  # eight: 73 %


def test_equal_steps_tell_nothing() -> None:
    model = StepCostModel()
    for _ in range(20):
        model.record(8, 0.1)
    assert model.fit() is None and model.threshold(8, 8) == 0.0


def test_draft_positions_are_kept_while_their_chance_beats_the_threshold() -> None:
    assert drafts_worth(0.9, 4, 0.0) == 4
    assert drafts_worth(0.9, 4, 0.75) == 2  # 0.9, 0.81 pass; 0.729 does not
    assert drafts_worth(0.5, 4, 0.73) == 0
    assert drafts_worth(1.0, 3, 0.99) == 3


def test_acceptance_is_per_token_among_the_drafts_tested() -> None:
    b = BackOff()
    assert b.acceptance("r") == 1.0
    b.record("r", 4, 4)  # all four accepted: 1.0
    assert b.acceptance("r") == 1.0
    b.record("r", 4, 1)  # one accepted, the second refused: 1 / 2
    assert b.acceptance("r") == pytest.approx(0.65 * 1.0 + 0.35 * 0.5)
