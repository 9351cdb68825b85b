"""When draft tokens pay: a step-cost model fitted online, and the drafts it gives each request.

A forward of T tokens costs about a + b * T seconds: on one request `a` (reading the weights)
dominates and drafts are nearly free; in a large batch the step is compute-bound and every draft
token costs nearly as much as an output token. A draft model adds its own forwards, one per draft
position. `plan_drafts` hands out draft positions across the batch, best chance first, while each one
adds more expected output tokens than its share of the step's cost, so speculation backs off for the
whole batch when it stops paying.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Mapping

import numpy as np

WINDOW = 64  # recent steps the fit uses
MIN_SAMPLES = 8
REFIT_EVERY = 8  # new samples between fits: a fit costs a few hundred microseconds, a step's share of it less
OUTLIER = 3.0  # a step this many median residuals off the line (a pause, a compile) is left out


class StepCostModel:
    """Least squares of step seconds on step tokens over the recent decode steps.

    Only steps of decode and draft tokens are recorded (a prefill chunk's tokens cost differently).
    A fit outlives the samples that made it: when every recent step has one size (drafting stopped),
    the last fit still says what a draft would cost."""

    def __init__(self) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=WINDOW)
        self._fit: tuple[float, float] | None = None
        self._new = 0  # samples since the last fit

    @property
    def samples(self) -> list[tuple[int, float]]:
        """The recent (tokens, seconds) the fit uses, oldest first."""
        return list(self._samples)

    def record(self, num_tokens: int, seconds: float) -> None:
        self._samples.append((num_tokens, seconds))
        self._new += 1

    def fit(self) -> tuple[float, float] | None:
        """(a, b) with a > 0 and b >= 0, or None until the steps have differed enough in size."""
        if self._new >= (REFIT_EVERY if self._fit else 1) and len(self._samples) >= MIN_SAMPLES:
            self._new = 0
            t = np.array([s[0] for s in self._samples], dtype=np.float64)
            y = np.array([s[1] for s in self._samples], dtype=np.float64)
            if t.max() > t.min():
                b, a = np.polyfit(t, y, 1)
                residual = np.abs(y - (a + b * t))
                keep = residual <= OUTLIER * np.median(residual) + 1e-12
                if keep.sum() >= MIN_SAMPLES and t[keep].max() > t[keep].min():
                    b, a = np.polyfit(t[keep], y[keep], 1)
                self._fit = (max(float(a), 1e-9), max(float(b), 0.0))
        return self._fit


def plan_drafts(
    acceptance: Mapping[str, float],
    k: int,
    fit: tuple[float, float] | None,
    base_tokens: int,
    depth_cost: float = 0.0,
) -> dict[str, int]:
    """Draft positions per request id for a step of `base_tokens` tokens besides the drafts, in which
    each request of `acceptance` (its per-token acceptance) outputs at least one token.

    Draft j of a request is accepted with chance acceptance ** j. The step costs a + b * T for its T
    tokens, plus `depth_cost` seconds per draft position of the deepest window (a draft model runs one
    batched forward per position; prompt lookup costs next to nothing). Positions are taken best chance
    first while one adds more expected tokens than its cost takes away: chance * C > E * (b + depth),
    with C and E the step's cost and expected outputs so far and `depth` the depth cost if it deepens the
    step. Without a fit yet, every request drafts k (the steps that follow make one)."""
    if fit is None:
        return dict.fromkeys(acceptance, k)
    a, b = fit
    tokens, expected, depth = float(base_tokens), float(len(acceptance)), 0
    planned = dict.fromkeys(acceptance, 0)
    heap = [(-p, rid, 1) for rid, p in acceptance.items() if k > 0 and p > 0]
    heapq.heapify(heap)
    while heap:
        negative, rid, j = heapq.heappop(heap)
        chance = -negative
        extra = b + (depth_cost if j > depth else 0.0)
        if chance * (a + b * tokens + depth_cost * depth) <= expected * extra:
            continue  # this request drafts no deeper; a shallower position of another may still pay
        planned[rid] = j
        tokens, expected, depth = tokens + 1, expected + chance, max(depth, j)
        if j < k:
            heapq.heappush(heap, (-chance * acceptance[rid], rid, j + 1))
    return planned


def drafts_can_pay(fit: tuple[float, float] | None, base_tokens: int, num_requests: int, depth_cost: float) -> bool:
    """Whether even a sure draft would pay: one more token must cost less than the step's cost per
    output token (a + b * T) / R. A proposer slower than that per position never pays here."""
    if fit is None or num_requests < 1:
        return True
    a, b = fit
    return b + depth_cost < (a + b * base_tokens) / num_requests
