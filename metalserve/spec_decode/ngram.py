"""Prompt-lookup drafts: the tokens that followed the latest earlier occurrence of the context's tail.

The longest tail n-gram (prompt_lookup_max down to prompt_lookup_min tokens) that also occurs earlier
in prompt + output wins; its most recent earlier occurrence with k tokens after it is the most local
guess (an edit copies the span it is working through). One scan of the request's tokens at C speed,
then a few candidates.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np


def propose_ngram(tokens: Sequence[int] | np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` draft tokens continuing `tokens`; [] when no tail n-gram recurs."""
    seq = tokens if isinstance(tokens, list) else np.asarray(tokens).tolist()
    total = len(seq)
    if k < 1 or total < min_n + 1:
        return []
    # Every earlier n-gram equal to the tail ends where the last token recurs: `list.index` finds those
    # ends (before the last token) at C speed, and the few there are are matched backwards.
    ends: list[int] = []
    with contextlib.suppress(ValueError):
        while True:
            ends.append(seq.index(seq[-1], ends[-1] + 1 if ends else 0, total - 1))
    longest = min(max_n, total - 1)
    lengths = []
    for end in ends:
        n = 1
        while n < longest and n <= end and seq[end - n] == seq[total - 1 - n]:
            n += 1
        lengths.append(n)
    for n in range(longest, min_n - 1, -1):
        hits = [end - n + 1 for end, length in zip(ends, lengths, strict=True) if length >= n]
        if hits:
            # The latest occurrence with k tokens after it, else the earliest (the longest run after it).
            full = [h for h in hits if h + n + k <= total]
            start = (full[-1] if full else hits[0]) + n
            return list(seq[start : start + k])
    return []
