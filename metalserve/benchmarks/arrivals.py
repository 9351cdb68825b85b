"""When each session starts: a Poisson process at `--request-rate`, or all at once when the rate is inf."""

from __future__ import annotations

import math
import random


def arrival_gaps(num: int, rate: float, seed: int) -> list[float]:
    """`num` waits in seconds before each arrival (the first included): exponential with mean 1/rate."""
    if num < 0:
        raise ValueError("the number of arrivals must be >= 0")
    if not rate > 0:
        raise ValueError(f"--request-rate must be > 0 or inf, got {rate}")
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    return [rng.expovariate(rate) for _ in range(num)]


def arrival_offsets(num: int, rate: float, seed: int) -> list[float]:
    """Start times relative to the run's start: the running sum of the gaps."""
    offsets, t = [], 0.0
    for gap in arrival_gaps(num, rate, seed):
        t += gap
        offsets.append(t)
    return offsets
