"""Print a run's metrics as a table and save them, with the run's settings, as JSON."""

from __future__ import annotations

import json
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from metalserve.benchmarks.metrics import BenchMetrics, LatencyStats
from metalserve.benchmarks.runner import RequestRecord

_LATENCIES = (
    ("ttft_ms", "Time to first token"),
    ("tpot_ms", "Time per output token (excl. 1st)"),
    ("itl_ms", "Inter-token latency"),
    ("e2el_ms", "End-to-end latency"),
)


def format_table(m: BenchMetrics, title: str = "Serving Benchmark Result") -> str:
    """A fixed-width table in the layout of `vllm bench serve`."""
    rows: list[tuple[str, str]] = [
        ("Successful requests:", str(m.completed)),
        ("Failed requests:", str(m.failed)),
        ("Benchmark duration (s):", f"{m.duration_s:.2f}"),
        ("Total input tokens:", str(m.total_input_tokens)),
        ("Total generated tokens:", str(m.total_output_tokens)),
        ("Request throughput (req/s):", f"{m.request_throughput:.2f}"),
        ("Output token throughput (tok/s):", f"{m.output_throughput:.2f}"),
        ("Total token throughput (tok/s):", f"{m.total_token_throughput:.2f}"),
    ]
    lines = [f"{' ' + title + ' ':=^60}"] + [f"{k:<40}{v:>20}" for k, v in rows]
    for key, heading in _LATENCIES:
        stats: LatencyStats = getattr(m, key)
        short = key.split("_")[0].upper()
        lines.append(f"{' ' + heading + ' ':-^60}")
        lines.append(f"{f'Mean {short} (ms):':<40}{stats.mean:>20.2f}")
        lines.append(f"{f'Median {short} (ms):':<40}{stats.median:>20.2f}")
        for name, value in stats.percentiles.items():
            lines.append(f"{f'P{name[1:]} {short} (ms):':<40}{value:>20.2f}")
    for err in m.errors:
        lines.append(f"error: {err}")
    lines.append("=" * 60)
    return "\n".join(lines)


def result_dict(m: BenchMetrics, settings: dict[str, Any], records: list[RequestRecord] | None) -> dict[str, Any]:
    """The JSON document: when, the settings, the metrics and (optionally) every request."""
    doc: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "settings": settings,
        "metrics": m.to_dict(),
    }
    if records is not None:
        doc["requests"] = [
            {k: v for k, v in asdict(r).items() if k != "outcome"}
            | {
                "success": r.outcome.success,
                "ttft_s": r.outcome.ttft,
                "latency_s": r.outcome.latency,
                "itl_s": r.outcome.itl,
                "error": r.outcome.error,
            }
            for r in records
        ]
    return doc


def save_json(doc: dict[str, Any], path: str | Path) -> Path:
    """Write `doc` (creating the folder); returns the path written."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, default=str) + "\n", encoding="utf-8")
    return out
