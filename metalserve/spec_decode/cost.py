"""When a draft token pays: a step-cost model fitted online, and the drafts it allows per request.

A forward of T tokens costs about a + b * T (seconds): on one request `a` (reading the weights)
dominates and drafts are nearly free; in a large batch the step is compute-bound and every draft
token costs nearly as much as an output token. Draft position j of a request is kept while its chance
of being accepted (the request's acceptance to the power j) beats b over the cost per output token of
the step without drafts, so speculation backs off for the whole batch when it stops paying.
"""

from __future__ import annotations

from collections import deque

import numpy as np

WINDOW = 64  # recent steps the fit uses
MIN_SAMPLES = 8


class StepCostModel:
    """Least squares of step seconds on step tokens over the recent steps."""

    def __init__(self) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=WINDOW)
        self._fit: tuple[float, float] | None = None

    def record(self, num_tokens: int, seconds: float) -> None:
        self._samples.append((num_tokens, seconds))
        self._fit = None

    def fit(self) -> tuple[float, float] | None:
        """(a, b) with b >= 0, or None until the steps differ enough in size to tell them apart."""
        if self._fit is None and len(self._samples) >= MIN_SAMPLES:
            t = np.array([s[0] for s in self._samples], dtype=np.float64)
            y = np.array([s[1] for s in self._samples], dtype=np.float64)
            if t.max() > t.min():
                b, a = np.polyfit(t, y, 1)
                self._fit = (max(float(a), 1e-9), max(float(b), 0.0))
        return self._fit

    def threshold(self, num_tokens: int, num_outputs: int) -> float:
        """The acceptance chance a draft token needs in a step of `num_tokens` tokens that outputs
        `num_outputs` tokens without drafts (0: any draft pays, or not known yet)."""
        fit = self.fit()
        if fit is None or num_outputs < 1:
            return 0.0
        a, b = fit
        return b * num_outputs / (a + b * num_tokens)


def drafts_worth(acceptance: float, k: int, threshold: float) -> int:
    """The most draft positions j <= k with acceptance ** j > threshold."""
    n, p = 0, 1.0
    while n < k:
        p *= acceptance
        if p <= threshold:
            break
        n += 1
    return n
