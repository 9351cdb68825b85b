"""The draft-rollback rule that the scheduler and the runner share."""

from __future__ import annotations

import pytest

from metalserve.spec_decode.rollback import num_rejected


def test_rejected_drafts_are_the_window_positions_without_a_token() -> None:
    assert num_rejected(3, 4) == 0  # every draft accepted, plus the bonus token
    assert num_rejected(3, 1) == 3  # every draft rejected: only the corrected token
    assert num_rejected(4, 2) == 3
    assert num_rejected(0, 1) == 0  # a plain decode


@pytest.mark.parametrize(("drafted", "sampled"), [(3, 0), (3, 5), (0, 2)])
def test_a_window_that_cannot_exist_is_an_error(drafted: int, sampled: int) -> None:
    with pytest.raises(ValueError, match="samples 1 to"):
        num_rejected(drafted, sampled)
