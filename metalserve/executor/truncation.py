"""Random sampling for a batch of rows: temperature, top-k, top-p, min-p, then one inverse-CDF draw.

Every filter becomes a per-row threshold, so the only full-vocabulary passes are one exponential and one
cumulative sum; top-k and top-p look at a few candidates from `mx.topk` instead of sorting the vocabulary.
Rows are scaled to base 2 (y = logit * log2(e) / T) because MLX's CPU backend computes 2**y about twice
as fast as exp, and the scaling folds into the temperature division.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from metalserve.sampling_params import SamplingParams

# Top-p first looks for the nucleus among this many best tokens; a row whose nucleus is wider (a very
# flat distribution) makes the step sort the whole vocabulary instead.
NUCLEUS_CANDIDATES = 256
LOG2E = 1.0 / math.log(2.0)


def _descending_top(y: mx.array, k: int) -> mx.array:
    """The k largest values of each row, best first."""
    top = y if k >= y.shape[-1] else mx.topk(y, k, axis=-1)
    return -mx.sort(-top, axis=-1)


def _top_k(y: mx.array, ks: list[int]) -> tuple[mx.array, mx.array]:
    """Mask each row below its k-th best value (rows with k == 0 untouched); also return the
    max(ks) best values per row, masked the same way, for top-p to reuse."""
    best = _descending_top(y, max(ks))
    index = mx.array([max(k, 1) - 1 for k in ks])[:, None]
    on = mx.array([k > 0 for k in ks])[:, None]
    kth = mx.where(on, mx.take_along_axis(best, index, axis=-1), -mx.inf)
    return mx.where(y >= kth, y, -mx.inf), mx.where(best >= kth, best, -mx.inf)


def _nucleus_threshold(
    best: mx.array, row_max: mx.array, total: mx.array, top_p: list[float]
) -> tuple[mx.array, mx.array]:
    """[R, 1] value of the last token in each row's nucleus (the fewest best tokens whose probability
    reaches top_p, at least one), and whether the candidates in `best` held every row's nucleus."""
    p = mx.array(top_p, dtype=mx.float32)[:, None]
    probs = mx.power(2.0, best - row_max) / total
    mass = mx.cumsum(probs, axis=-1)
    # Tokens whose preceding mass is still below top_p belong to the nucleus.
    count = mx.sum((mass - probs) < p, axis=-1, keepdims=True)
    threshold = mx.take_along_axis(best, mx.maximum(count, 1) - 1, axis=-1)
    return mx.where(p < 1.0, threshold, -mx.inf), mx.all((mass[:, -1:] >= p) | (p >= 1.0))


def _top_p(
    y: mx.array, best: mx.array | None, row_max: mx.array, weights: mx.array, top_p: list[float]
) -> mx.array:
    """Top-p threshold per row, from the top-k candidates, else the best few, else the whole row."""
    total = mx.sum(weights, axis=-1, keepdims=True)
    if best is None:
        best = _descending_top(y, min(NUCLEUS_CANDIDATES, y.shape[-1]))
    threshold, covered = _nucleus_threshold(best, row_max, total, top_p)
    if best.shape[-1] < y.shape[-1] and not covered.item():
        threshold, _ = _nucleus_threshold(_descending_top(y, y.shape[-1]), row_max, total, top_p)
    return threshold


def sample_rows(logits: mx.array, params: Sequence[SamplingParams], uniforms: np.ndarray) -> mx.array:
    """Sample one token id per row of float32 logits [R, V]; uniforms[i] in [0, 1) drives row i's draw."""
    vocab = logits.shape[-1]
    y = logits * mx.array([LOG2E / p.temperature for p in params], dtype=mx.float32)[:, None]
    ks = [p.top_k if p.top_k < vocab else 0 for p in params]
    top_p = [p.top_p for p in params]
    best = None
    if max(ks) > 0:
        y, best = _top_k(y, ks)
        # A top-p row's nucleus lies inside its own k best only if it has a top-k.
        if any(k == 0 and p < 1.0 for k, p in zip(ks, top_p, strict=True)):
            best = None
    row_max = mx.max(y, axis=-1, keepdims=True)
    weights = mx.power(2.0, y - row_max)  # unnormalised probabilities; the best token's weight is 1
    log2_min_p = [math.log2(p.min_p) if p.min_p > 0 else -math.inf for p in params]
    threshold = row_max + mx.array(log2_min_p, dtype=mx.float32)[:, None]
    if min(top_p) < 1.0:
        threshold = mx.maximum(threshold, _top_p(y, best, row_max, weights, top_p))
    weights = mx.where(y >= threshold, weights, 0.0)
    cdf = mx.cumsum(weights, axis=-1)
    # The first token whose cumulative weight exceeds u * total; u < 1 keeps it inside the vocabulary.
    target = mx.array(uniforms, dtype=mx.float32)[:, None] * cdf[:, -1:]
    return mx.sum(cdf <= target, axis=-1).astype(mx.int32)
