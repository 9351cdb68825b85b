"""Random sampling for a batch of rows: temperature, top-k, top-p, min-p, then one inverse-CDF draw.

Every filter becomes a per-row logit threshold, so the only full-vocabulary passes are one exp and one
cumulative sum; top-k and top-p look at a few candidates from `mx.topk` instead of sorting the vocabulary.
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


def _descending_top(z: mx.array, k: int) -> mx.array:
    """The k largest values of each row, best first."""
    top = z if k >= z.shape[-1] else mx.topk(z, k, axis=-1)
    return -mx.sort(-top, axis=-1)


def _top_k_threshold(z: mx.array, ks: list[int]) -> mx.array | None:
    """[R, 1] logit of each row's k-th best token (-inf where top-k is off); None when no row uses it."""
    kmax = max(ks)
    if kmax == 0:
        return None
    best = _descending_top(z, kmax)
    index = mx.array([max(k, 1) - 1 for k in ks])[:, None]
    on = mx.array([k > 0 for k in ks])[:, None]
    return mx.where(on, mx.take_along_axis(best, index, axis=-1), -mx.inf)


def _nucleus_threshold(
    z: mx.array, row_max: mx.array, total: mx.array, top_p: list[float], k: int
) -> mx.array:
    """[R, 1] logit of the last token in each row's nucleus: the fewest best tokens whose probability
    reaches top_p (at least one). Widens to the whole vocabulary if `k` candidates do not cover it."""
    p = mx.array(top_p, dtype=mx.float32)[:, None]
    best = _descending_top(z, k)
    probs = mx.exp(best - row_max) / total
    mass = mx.cumsum(probs, axis=-1)
    covered = (mass[:, -1:] >= p) | (p >= 1.0)
    if k < z.shape[-1] and not bool(mx.all(covered).item()):
        return _nucleus_threshold(z, row_max, total, top_p, z.shape[-1])
    # Tokens whose preceding mass is still below top_p belong to the nucleus.
    count = mx.sum((mass - probs) < p, axis=-1, keepdims=True)
    threshold = mx.take_along_axis(best, mx.maximum(count, 1) - 1, axis=-1)
    return mx.where(p < 1.0, threshold, -mx.inf)


def _min_p_threshold(row_max: mx.array, min_p: list[float]) -> mx.array:
    """[R, 1] logit below which a token's probability is under min_p times the best one's."""
    log_min_p = mx.array([math.log(m) if m > 0 else -math.inf for m in min_p], dtype=mx.float32)
    return row_max + log_min_p[:, None]


def sample_rows(logits: mx.array, params: Sequence[SamplingParams], uniforms: np.ndarray) -> mx.array:
    """Sample one token id per row of float32 logits [R, V]; uniforms[i] in [0, 1) drives row i's draw."""
    vocab = logits.shape[-1]
    z = logits / mx.array([p.temperature for p in params], dtype=mx.float32)[:, None]
    ks = [p.top_k if p.top_k < vocab else 0 for p in params]
    kth = _top_k_threshold(z, ks)
    if kth is not None:
        z = mx.where(z >= kth, z, -mx.inf)
    row_max = mx.max(z, axis=-1, keepdims=True)
    weights = mx.exp(z - row_max)  # unnormalised probabilities; the best token's weight is 1
    threshold = _min_p_threshold(row_max, [p.min_p for p in params])
    top_p = [p.top_p for p in params]
    if min(top_p) < 1.0:
        # A top-k row's nucleus lies inside its k tokens, so those are enough candidates.
        k = max(ks) if all(k > 0 for k, p in zip(ks, top_p, strict=True) if p < 1.0) else NUCLEUS_CANDIDATES
        total = mx.sum(weights, axis=-1, keepdims=True)
        nucleus = _nucleus_threshold(z, row_max, total, top_p, min(k, vocab))
        threshold = mx.maximum(threshold, nucleus)
    weights = mx.where(z >= threshold, weights, 0.0)
    cdf = mx.cumsum(weights, axis=-1)
    # The first token whose cumulative weight exceeds u * total; u < 1 keeps it inside the vocabulary.
    target = mx.array(uniforms, dtype=mx.float32)[:, None] * cdf[:, -1:]
    return mx.sum(cdf <= target, axis=-1).astype(mx.int32)
