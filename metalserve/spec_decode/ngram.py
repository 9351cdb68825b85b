"""Prompt-lookup drafts: the tokens that followed the latest earlier occurrence of the context's tail.

The longest tail n-gram (prompt_lookup_max down to prompt_lookup_min tokens) that also occurs earlier
in prompt + output wins; its most recent earlier occurrence with k tokens after it is the most local
guess (an edit copies the span it is working through). Pure NumPy: one pass over the request's tokens,
then a few candidates.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram(tokens: Sequence[int] | np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` draft tokens continuing `tokens`; [] when no tail n-gram recurs."""
    seq = np.asarray(tokens, dtype=np.int64)
    total = seq.shape[0]
    if k < 1 or total < min_n + 1:
        return []
    # Every earlier n-gram equal to the tail ends where the last token recurs: one pass finds those ends
    # (before the last token), and only they are checked against the longer tails.
    ends = np.flatnonzero(seq[: total - 1] == seq[total - 1])
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        candidates = ends[ends >= n - 1]
        match = np.ones(candidates.shape[0], dtype=bool)
        for back in range(1, n):
            match &= seq[candidates - back] == seq[total - 1 - back]
        hits = candidates[match] - (n - 1)  # where each occurrence starts
        if hits.size:
            # The latest occurrence with k tokens after it, else the earliest (the longest run after it).
            full = hits[hits + n + k <= total]
            start = int(full[-1] if full.size else hits[0]) + n
            return seq[start : start + k].tolist()
    return []
