"""Grammar masks for every position of a window: the matcher walks the drafts, then goes back.

Position j of a grammar-constrained window is masked with the grammar's state after drafts d1..dj.
The request's matcher consumes the drafts one by one (computing each mask before the next draft),
stops at the first draft the grammar refuses (the target's masked draw can never equal it, so no
later draft is accepted) and is then replayed from the request's output, so the scheduler advances it
by the accepted tokens only. Positions after a refused draft are not masked: they are never kept.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from metalserve.structured.bitmask import BatchMasker
from metalserve.structured.state import GrammarState

_MASKER = BatchMasker(num_threads=1)


class FixedMask:
    """A window row's grammar mask, computed ahead (the sampler adds `bias`; None: unconstrained)."""

    def __init__(self, bias: np.ndarray | None) -> None:
        self.bias = bias

    @property
    def constrains_next(self) -> bool:
        return self.bias is not None


def window_masks(
    state: GrammarState, output_token_ids: Sequence[int], drafts: Sequence[int], logits_vocab: int
) -> list[FixedMask]:
    """One mask per window position (len(drafts) + 1); `state` is left as `output_token_ids` made it."""
    masks: list[FixedMask] = []
    if state.num_seen != len(output_token_ids):
        state.replay(output_token_ids)
    try:
        for j in range(len(drafts) + 1):
            bias = _MASKER.bias([state], state.vocab_size, logits_vocab)[0].copy() if state.constrains_next else None
            masks.append(FixedMask(bias))
            if j == len(drafts):
                break
            draft = drafts[j]
            if (bias is not None and not np.isfinite(bias[draft])) or state.terminated:
                masks += [FixedMask(None)] * (len(drafts) - j)
                break
            state.accept(draft)
    finally:
        state.replay(output_token_ids)
    return masks
