"""Aggregation: counts, token totals, throughput, TPOT and percentiles on hand-made records."""

from __future__ import annotations

import pytest

from metalserve.benchmarks.client import RequestOutcome
from metalserve.benchmarks.metrics import compute_metrics, latency_stats, tpot
from metalserve.benchmarks.report import format_table, result_dict
from metalserve.benchmarks.runner import RequestRecord


def _rec(ttft: float, latency: float, out_tokens: int, itl: list[float], ok: bool = True) -> RequestRecord:
    outcome = RequestOutcome(ok, 0.0, latency, ttft, itl, "x", out_tokens, 10, "" if ok else "HTTP 500: boom")
    return RequestRecord(0, 0, 10, out_tokens, out_tokens if ok else 0, outcome)


def test_tpot_excludes_the_first_token() -> None:
    assert tpot(_rec(0.5, 2.5, 5, [])) == pytest.approx(0.5)
    assert tpot(_rec(0.5, 0.5, 1, [])) is None


def test_compute_metrics_counts_and_throughput() -> None:
    records = [
        _rec(0.1, 1.1, 11, [0.1] * 10),
        _rec(0.3, 2.3, 21, [0.1] * 20),
        _rec(0.0, 0.2, 0, [], ok=False),
    ]
    m = compute_metrics(records, duration_s=4.0, percentiles=[50, 99])
    assert (m.completed, m.failed) == (2, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (20, 32)
    assert m.output_throughput == pytest.approx(8.0)
    assert m.request_throughput == pytest.approx(0.5)
    assert m.total_token_throughput == pytest.approx(13.0)
    assert m.ttft_ms.mean == pytest.approx(200.0)
    assert m.tpot_ms.mean == pytest.approx(100.0)
    assert m.itl_ms.median == pytest.approx(100.0)
    assert m.e2el_ms.percentiles["p99"] == pytest.approx(1100 + 0.99 * 1200)
    assert m.errors == ["HTTP 500: boom"]


def test_latency_stats_percentiles_and_empty() -> None:
    s = latency_stats([0.001 * i for i in range(1, 101)], [50, 90])
    assert s.median == pytest.approx(50.5)
    assert s.percentiles["p90"] == pytest.approx(90.1)
    assert latency_stats([], [99]).percentiles == {"p99": 0.0}


def test_bad_duration_raises() -> None:
    with pytest.raises(ValueError, match="duration"):
        compute_metrics([], 0.0)


def test_table_and_json_carry_the_numbers() -> None:
    m = compute_metrics([_rec(0.1, 1.1, 11, [0.1] * 10)], 2.0)
    table = format_table(m)
    assert "Successful requests:" in table and "Mean TTFT (ms):" in table and "P99 ITL (ms):" in table
    assert "100.00" in table  # TTFT and ITL in ms
    doc = result_dict(m, {"max_concurrency": 8}, [_rec(0.1, 1.1, 11, [0.1])])
    assert doc["settings"] == {"max_concurrency": 8}
    assert doc["metrics"]["output_throughput"] == pytest.approx(5.5)
    assert doc["requests"][0]["ttft_s"] == pytest.approx(0.1)
