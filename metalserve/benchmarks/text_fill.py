"""Build text of an exact token length with any tokenizer that can only encode."""

from __future__ import annotations

import random
from collections.abc import Sequence

from metalserve.benchmarks.tokenizer import TokenCounter

_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"


def pseudo_words(rng: random.Random, n: int) -> list[str]:
    """`n` pronounceable nonsense words: prompts that no server has cached and no model has memorised."""
    words = []
    for _ in range(n):
        syllables = rng.randint(1, 3)
        words.append("".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(syllables)))
    return words


def fit_words(tok: TokenCounter, words: Sequence[str], target: int, sep: str = " ") -> tuple[str, int]:
    """The longest prefix of `words` (joined by `sep`) with at most `target` tokens, and its token count.

    Token counts of prefixes grow with the prefix, so a bisection needs ~log2(len(words)) encodes.
    """
    if target < 1:
        raise ValueError(f"a prompt needs at least 1 token, asked for {target}")

    def count(k: int) -> int:
        return len(tok.encode(sep.join(words[:k])))

    lo, hi = 1, len(words)
    if count(hi) <= target:
        raise ValueError(f"{len(words)} words make fewer than {target} tokens; give more words")
    while lo < hi:  # invariant: the answer is in [lo, hi)
        mid = (lo + hi + 1) // 2
        if count(mid) <= target:
            lo = mid
        else:
            hi = mid - 1
    text = sep.join(words[:lo])
    return text, len(tok.encode(text))


def random_text(tok: TokenCounter, rng: random.Random, target: int) -> tuple[str, int]:
    """Fresh nonsense text of about `target` tokens (at most `target`; usually exactly)."""
    # Every word is at least one token, so target + 8 words always exceed the target.
    words = pseudo_words(rng, max(8, target + 8))
    return fit_words(tok, words, target)
