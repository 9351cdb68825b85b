"""Summary statistics of a run: latencies (mean, median, std, percentiles), throughput and counts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from metalserve.benchmarks.runner import RequestRecord

DEFAULT_PERCENTILES = (99.0,)


@dataclass(frozen=True)
class LatencyStats:
    """One latency metric in milliseconds; percentiles keyed like `p99`."""

    mean: float
    median: float
    std: float
    percentiles: dict[str, float] = field(default_factory=dict)


def latency_stats(values_s: Sequence[float], percentiles: Sequence[float]) -> LatencyStats:
    """Stats of `values_s` (seconds) reported in ms; all zeros when there are no values."""
    if not values_s:
        return LatencyStats(0.0, 0.0, 0.0, {_pkey(p): 0.0 for p in percentiles})
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    pct = {_pkey(p): float(np.percentile(ms, p)) for p in percentiles}
    return LatencyStats(float(ms.mean()), float(np.median(ms)), float(ms.std()), pct)


def _pkey(p: float) -> str:
    return f"p{p:g}"


@dataclass(frozen=True)
class BenchMetrics:
    """Everything the report prints: counts, token totals, throughputs and the four latency metrics."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    itl_ms: LatencyStats
    e2el_ms: LatencyStats
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def tpot(record: RequestRecord) -> float | None:
    """Time per output token after the first: (latency - TTFT) / (tokens - 1); None for one token."""
    if record.output_tokens < 2:
        return None
    return (record.outcome.latency - record.outcome.ttft) / (record.output_tokens - 1)


def compute_metrics(
    records: Sequence[RequestRecord], duration_s: float, percentiles: Sequence[float] = DEFAULT_PERCENTILES
) -> BenchMetrics:
    """Aggregate the run; failed requests count only in `failed` (and their first errors are kept)."""
    if duration_s <= 0:
        raise ValueError("the run's duration must be positive")
    ok = [r for r in records if r.outcome.success]
    bad = [r for r in records if not r.outcome.success]
    tokens_in = sum(r.prompt_len for r in ok)
    tokens_out = sum(r.output_tokens for r in ok)
    tpots = [t for t in (tpot(r) for r in ok) if t is not None]
    return BenchMetrics(
        completed=len(ok),
        failed=len(bad),
        duration_s=duration_s,
        total_input_tokens=tokens_in,
        total_output_tokens=tokens_out,
        request_throughput=len(ok) / duration_s,
        output_throughput=tokens_out / duration_s,
        total_token_throughput=(tokens_in + tokens_out) / duration_s,
        ttft_ms=latency_stats([r.outcome.ttft for r in ok], percentiles),
        tpot_ms=latency_stats(tpots, percentiles),
        itl_ms=latency_stats([gap for r in ok for gap in r.outcome.itl], percentiles),
        e2el_ms=latency_stats([r.outcome.latency for r in ok], percentiles),
        errors=sorted({r.outcome.error for r in bad})[:10],
    )
