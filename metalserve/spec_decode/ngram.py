"""Prompt-lookup drafts: the tokens that followed the latest earlier occurrence of the context's tail.

The longest tail n-gram (prompt_lookup_max down to prompt_lookup_min tokens) that also occurs earlier
in prompt + output wins; its most recent earlier occurrence with k tokens after it is the most local
guess (an edit copies the span it is working through). Pure NumPy over the request's tokens: a few tens of microseconds.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: Sequence[int] | np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` draft tokens continuing `tokens`; [] when no tail n-gram recurs."""
    seq = np.asarray(tokens, dtype=np.int64)
    total = seq.shape[0]
    if k < 1 or total < min_n + 1:
        return []
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        tail = seq[total - n :]
        # Windows starting at 0 .. total-n-1: every earlier occurrence with a token after it.
        windows = sliding_window_view(seq[: total - 1], n)
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if hits.size:
            # The latest occurrence with k tokens after it, else the earliest (the longest run after it).
            full = hits[hits + n + k <= total]
            start = int(full[-1] if full.size else hits[0]) + n
            return seq[start : start + k].tolist()
    return []
