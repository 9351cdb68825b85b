"""Uniform draws for the sampler: one per sampled row, reproducible for requests that carry a seed."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_MASK64 = (1 << 64) - 1
# The largest float32 below 1 whose product with any positive float32 t rounds to below t, so that
# u * total never reaches the last value of a cumulative sum (see truncation.sample_rows).
MAX_UNIFORM = 1.0 - 2.0**-23


def _mix64(z: int) -> int:
    """SplitMix64's finaliser: a bijective 64-bit mix with full avalanche."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def seeded_uniform(seed: int, step: int) -> float:
    """A uniform in [0, 1) that depends only on (seed, step): the same text twice, whatever the batch."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    # Two rounds so that nearby (seed, step) pairs give unrelated draws.
    z = _mix64(_mix64(seed & _MASK64) ^ (step & _MASK64))
    return (z >> 11) * 2.0**-53


class UniformSource:
    """Draws one uniform per row: from the request's own stream if it has a seed, else the engine RNG."""

    def __init__(self, seed: int = 0) -> None:
        self._rng = np.random.default_rng(seed)

    def draw(self, seeds: Sequence[int | None], steps: Sequence[int]) -> np.ndarray:
        """float32 uniforms in [0, MAX_UNIFORM], one per row; steps[i] is row i's output length so far."""
        if len(seeds) != len(steps):
            raise ValueError(f"{len(seeds)} seeds but {len(steps)} steps")
        out = self._rng.random(len(seeds))
        for i, seed in enumerate(seeds):
            if seed is not None:
                out[i] = seeded_uniform(seed, steps[i])
        return np.minimum(out, MAX_UNIFORM).astype(np.float32)
