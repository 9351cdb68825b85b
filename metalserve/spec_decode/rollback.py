"""The one draft-rollback rule, shared by the scheduler's and the runner's copies of a request's state."""

from __future__ import annotations


def num_rejected(num_drafted: int, num_sampled: int) -> int:
    """Positions of a verify window that hold no token: its rejected drafts.

    A window computes the decode token and `num_drafted` drafts, and samples the accepted drafts plus one
    token (`num_sampled`). The rejected drafts' KV is stale, so both sides stop counting it as computed:
    the next step overwrites it, and only accepted tokens are ever hashed into the prefix cache."""
    if not 1 <= num_sampled <= num_drafted + 1:
        raise ValueError(f"a window of {num_drafted} drafts samples 1 to {num_drafted + 1} tokens, not {num_sampled}")
    return num_drafted + 1 - num_sampled
