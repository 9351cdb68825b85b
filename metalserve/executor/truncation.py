"""Random sampling for a batch of rows: temperature, top-k, top-p, min-p, then one inverse-CDF draw.

Every filter becomes a per-row threshold, so the only full-vocabulary passes are one exponential and one
cumulative sum; top-k and top-p look at a few best candidates instead of sorting the vocabulary.
Rows are scaled to the backend's exponential base (y = logit / (T ln b)), folded into the temperature.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from metalserve.executor.array_backend import Array, ArrayBackend
from metalserve.sampling_params import SamplingParams

# Top-p first looks for the nucleus among this many best tokens; a row whose nucleus is wider (a very
# flat distribution) makes the step sort the whole vocabulary instead.
NUCLEUS_CANDIDATES = 256


def _top_k(be: ArrayBackend, y: Array, ks: list[int]) -> tuple[Array, Array]:
    """Mask each row below its k-th best value (rows with k == 0 untouched); also return the
    max(ks) best values per row, masked the same way, for top-p to reuse."""
    xp = be.xp
    best = be.top(y, max(ks))
    index = be.asarray([max(k, 1) - 1 for k in ks], "int32")[:, None]
    on = be.asarray([k > 0 for k in ks], "bool_")[:, None]
    kth = xp.where(on, xp.take_along_axis(best, index, axis=-1), -math.inf)
    return xp.where(y >= kth, y, -math.inf), xp.where(best >= kth, best, -math.inf)


def _nucleus_threshold(
    be: ArrayBackend, best: Array, row_max: Array, total: Array, top_p: list[float]
) -> tuple[Array, Array]:
    """[R, 1] value of the last token in each row's nucleus (the fewest best tokens whose probability
    reaches top_p, at least one), and whether the candidates in `best` held every row's nucleus."""
    xp = be.xp
    p = be.asarray(top_p)[:, None]
    probs = be.exp(best - row_max) / total
    mass = xp.cumsum(probs, axis=-1)
    # Tokens whose preceding mass is still below top_p belong to the nucleus.
    count = xp.sum((mass - probs) < p, axis=-1, keepdims=True)
    threshold = xp.take_along_axis(best, xp.maximum(count, 1) - 1, axis=-1)
    return xp.where(p < 1.0, threshold, -math.inf), xp.all((mass[:, -1:] >= p) | (p >= 1.0))


def _top_p(be: ArrayBackend, y: Array, best: Array | None, row_max: Array, weights: Array, top_p: list[float]) -> Array:
    """Top-p threshold per row, from the top-k candidates, else the best few, else the whole row."""
    total = be.xp.sum(weights, axis=-1, keepdims=True)
    if best is None:
        best = be.top(y, min(NUCLEUS_CANDIDATES, y.shape[-1]))
    threshold, covered = _nucleus_threshold(be, best, row_max, total, top_p)
    if best.shape[-1] < y.shape[-1] and not covered.item():
        threshold, _ = _nucleus_threshold(be, be.top(y, y.shape[-1]), row_max, total, top_p)
    return threshold


def sample_rows(be: ArrayBackend, logits: Array, params: Sequence[SamplingParams], uniforms: np.ndarray) -> Array:
    """Sample one token id per row of float32 logits [R, V]; uniforms[i] in [0, 1) drives row i's draw."""
    step = be.row_chunk or logits.shape[0]
    parts = [
        _sample_chunk(be, logits[i : i + step], params[i : i + step], uniforms[i : i + step])
        for i in range(0, logits.shape[0], step)
    ]
    return parts[0] if len(parts) == 1 else be.xp.concatenate(parts)


def _sample_chunk(be: ArrayBackend, logits: Array, params: Sequence[SamplingParams], uniforms: np.ndarray) -> Array:
    xp = be.xp
    vocab = logits.shape[-1]
    scale = 1.0 / math.log(be.log_base)
    y = logits * be.asarray([scale / p.temperature for p in params])[:, None]
    ks = [p.top_k if p.top_k < vocab else 0 for p in params]
    top_p = [p.top_p for p in params]
    best = None
    if max(ks) > 0:
        y, best = _top_k(be, y, ks)
        # A top-p row's nucleus lies inside its own k best only if it has a top-k.
        if any(k == 0 and p < 1.0 for k, p in zip(ks, top_p, strict=True)):
            best = None
    row_max = xp.max(y, axis=-1, keepdims=True)
    weights = be.exp(y - row_max)  # unnormalised probabilities; the best token's weight is 1
    threshold = row_max + be.asarray([be.log(p.min_p) for p in params])[:, None]
    if min(top_p) < 1.0:
        threshold = xp.maximum(threshold, _top_p(be, y, best, row_max, weights, top_p))
    weights = xp.where(y >= threshold, weights, 0.0)
    cdf = xp.cumsum(weights, axis=-1)
    # The first token whose cumulative weight exceeds u * total; u < 1 keeps it inside the vocabulary.
    target = be.asarray(uniforms)[:, None] * cdf[:, -1:]
    return xp.sum(cdf <= target, axis=-1).astype(xp.int32)
