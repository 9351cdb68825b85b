"""Prompt-lookup drafts and the back-off that stops drafting for requests whose drafts keep failing."""

from __future__ import annotations

from metalserve.spec_decode.backoff import FIRST_COOLDOWN, BackOff
from metalserve.spec_decode.ngram import propose_ngram


def test_the_longest_recurring_tail_proposes_what_followed_it() -> None:
    # Tail [1, 2, 3] recurs at 0 (followed by 4 5 9); the 1-gram [3] also recurs at 6 (followed by 7).
    tokens = [1, 2, 3, 4, 5, 9, 3, 7, 8, 1, 2, 3]
    assert propose_ngram(tokens, 3, 1, 3) == [4, 5, 9]
    assert propose_ngram(tokens, 3, 1, 1) == [7, 8, 1]  # only 1-grams: the latest full occurrence


def test_no_recurring_tail_means_no_drafts() -> None:
    assert propose_ngram([5, 6, 7, 8], 4, 1, 3) == []
    assert propose_ngram([1, 2, 9, 1, 2, 8], 4, 3, 3) == []  # only 2-grams recur, min is 3
    assert propose_ngram([1], 4, 1, 3) == []


def test_a_short_continuation_is_kept_when_no_full_one_exists() -> None:
    assert propose_ngram([4, 4, 4, 4], 3, 1, 2) == [4, 4]
    assert propose_ngram([1, 2, 3, 1, 2], 5, 2, 2) == [3, 1, 2]


def test_backoff_pauses_a_failing_request_and_doubles_its_cooldown() -> None:
    b = BackOff()
    assert b.may_draft("a")
    pauses = 0
    for _ in range(3):  # three windows with nothing accepted push the average below the floor
        b.record("a", 4, 0)
    while not b.may_draft("a"):
        pauses += 1
    assert pauses == FIRST_COOLDOWN
    b.record("a", 4, 0)
    b.record("a", 4, 0)
    pauses = 0
    while not b.may_draft("a"):
        pauses += 1
    assert pauses == 2 * FIRST_COOLDOWN


def test_backoff_leaves_a_good_request_alone_and_forgets_finished_ones() -> None:
    b = BackOff()
    for _ in range(50):
        b.record("good", 4, 3)
        assert b.may_draft("good")
    for _ in range(3):
        b.record("bad", 4, 0)
    assert not b.may_draft("bad")
    b.forget("bad")
    assert b.may_draft("bad")


def brute_force_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, one n-gram and one earlier start at a time."""
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        tail = tokens[total - n :]
        starts = [s for s in range(total - n) if tokens[s : s + n] == tail]  # each followed by a token
        if starts:
            full = [s for s in starts if s + n + k <= total]
            start = (full[-1] if full else starts[0]) + n
            return tokens[start : start + k]
    return []


def test_prompt_lookup_agrees_with_its_definition_on_random_sequences() -> None:
    import random

    rng = random.Random(5)
    for _ in range(400):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]  # 4 symbols: many recurrences
        k, low = rng.randrange(1, 6), rng.randrange(1, 4)
        high = low + rng.randrange(0, 3)
        assert propose_ngram(tokens, k, low, high) == brute_force_ngram(tokens, k, low, high), (tokens, k, low, high)
