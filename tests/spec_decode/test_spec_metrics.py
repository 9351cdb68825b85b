"""vLLM's spec_decode counters on /metrics and the acceptance in the stats log line."""

from __future__ import annotations

from prometheus_client import generate_latest

from metalserve.api.metrics import Metrics
from metalserve.engine.request_output import IterationStats
from metalserve.scheduler.stats import SchedulerStats


def stats(drafts: int, tokens: int, accepted: int, per_pos: tuple[int, ...]) -> SchedulerStats:
    return SchedulerStats(1, 0, 0.1, 0, 0, 0, 10, 10, 0, 0, 0, drafts, tokens, accepted, per_pos)


def sample(metrics: Metrics, name: str, **labels: str) -> float | None:
    value = metrics.registry.get_sample_value(name, {"model_name": "m", **labels})
    return value


def test_counters_take_the_increments_of_the_cumulative_counts() -> None:
    m = Metrics("m")
    m.on_step(stats(2, 8, 5, (2, 2, 1, 0)), IterationStats())
    m.on_step(stats(3, 12, 6, (3, 2, 1, 0)), IterationStats())
    assert sample(m, "vllm:spec_decode_num_drafts_total") == 3
    assert sample(m, "vllm:spec_decode_num_draft_tokens_total") == 12
    assert sample(m, "vllm:spec_decode_num_accepted_tokens_total") == 6
    assert sample(m, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") == 3
    assert sample(m, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="2") == 1
    assert b"vllm:spec_decode_num_drafts_total" in generate_latest(m.registry)


def test_the_log_line_reports_acceptance_since_the_previous_line() -> None:
    m = Metrics("m")
    m.on_step(stats(2, 8, 4, (2, 1, 1, 0)), IterationStats())
    line = m.log_state.line()
    assert "draft acceptance rate: 50.0%, mean acceptance length: 3.00" in line
    m.on_step(stats(4, 16, 12, (4, 3, 3, 2)), IterationStats())
    assert "draft acceptance rate: 100.0%" in m.log_state.line()  # 8 more drafted, 8 more accepted


def test_no_speculation_no_spec_part_in_the_line() -> None:
    m = Metrics("m")
    m.on_step(stats(0, 0, 0, ()), IterationStats())
    assert "Spec decode" not in m.log_state.line()
    assert sample(m, "vllm:spec_decode_num_drafts_total") in (None, 0.0)
