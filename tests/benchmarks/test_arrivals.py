"""Poisson arrivals: exponential gaps with mean 1/rate, all at once for inf, same seed same schedule."""

from __future__ import annotations

import statistics

import pytest

from metalserve.benchmarks.arrivals import arrival_gaps, arrival_offsets


def test_infinite_rate_sends_everything_at_once() -> None:
    assert arrival_gaps(5, float("inf"), 0) == [0.0] * 5


def test_poisson_gaps_have_mean_one_over_rate() -> None:
    gaps = arrival_gaps(20000, 4.0, seed=1)
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.03)
    # Exponential: the standard deviation equals the mean (a uniform or fixed spacing would fail this).
    assert statistics.pstdev(gaps) == pytest.approx(0.25, rel=0.05)


def test_offsets_are_cumulative_and_seeded() -> None:
    gaps = arrival_gaps(4, 2.0, seed=3)
    offsets = arrival_offsets(4, 2.0, seed=3)
    assert offsets == pytest.approx([sum(gaps[: i + 1]) for i in range(4)])
    assert arrival_offsets(4, 2.0, seed=3) == offsets
    assert arrival_offsets(4, 2.0, seed=4) != offsets


@pytest.mark.parametrize("rate", [0.0, -1.0, float("nan")])
def test_bad_rate_raises(rate: float) -> None:
    with pytest.raises(ValueError, match="request-rate"):
        arrival_gaps(3, rate, 0)
