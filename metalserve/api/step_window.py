"""The last minutes of one model's steps, for the status page: throughput over a short window, TTFT and
TPOT over a longer one. Written by the engine thread, read by the event loop."""

from __future__ import annotations

import collections
import statistics
import threading
import time
from typing import Any

from metalserve.engine.request_output import IterationStats

THROUGHPUT_WINDOW_S = 10.0  # tokens per second: what the engine does now
LATENCY_WINDOW_S = 300.0  # TTFT and TPOT: the last five minutes


class StepWindow:
    """Per-step token counts and latencies with their times, dropped once older than the latency window."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens: collections.deque[tuple[float, int, int]] = collections.deque()
        self._ttft: collections.deque[tuple[float, float]] = collections.deque()
        self._itl: collections.deque[tuple[float, float]] = collections.deque()
        self.started = time.monotonic()

    def record(self, iteration: IterationStats, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            if iteration.num_prompt_tokens or iteration.num_generation_tokens:
                self._tokens.append((now, iteration.num_prompt_tokens, iteration.num_generation_tokens))
            self._ttft.extend((now, v) for v in iteration.time_to_first_tokens)
            self._itl.extend((now, v) for v in iteration.inter_token_latencies)
            self._trim(now)

    def _trim(self, now: float) -> None:
        for queue in (self._tokens, self._ttft, self._itl):
            while queue and now - queue[0][0] > LATENCY_WINDOW_S:
                queue.popleft()

    def summary(self, now: float | None = None) -> dict[str, Any]:
        """Tokens per second over the short window; TTFT and TPOT (mean, median, p90, in ms) over the long."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._trim(now)
            recent = [(p, g) for t, p, g in self._tokens if now - t <= THROUGHPUT_WINDOW_S]
            ttft = [v for _, v in self._ttft]
            itl = [v for _, v in self._itl]
        span = min(THROUGHPUT_WINDOW_S, max(now - self.started, 1e-3))
        return {
            "prompt_tokens_per_s": round(sum(p for p, _ in recent) / span, 2),
            "generation_tokens_per_s": round(sum(g for _, g in recent) / span, 2),
            "ttft_ms": _quantiles(ttft),
            "tpot_ms": _quantiles(itl),
            "window_s": {"throughput": THROUGHPUT_WINDOW_S, "latency": LATENCY_WINDOW_S},
        }


def _quantiles(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"count": 0, "mean": None, "p50": None, "p90": None}
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return {
        "count": len(values),
        "mean": round(1000 * statistics.fmean(values), 2),
        "p50": round(1000 * statistics.median(ordered), 2),
        "p90": round(1000 * p90, 2),
    }
