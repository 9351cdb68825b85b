"""Log-probabilities to report: vLLM V1's default, taken from the raw model logits."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from metalserve.executor.truncation import LOG2E
from metalserve.outputs import TokenLogprob


class PendingLogprobs:
    """Lazy logprob arrays for some rows of a step; `resolve` turns them into TokenLogprob after eval."""

    def __init__(self, logits: mx.array, rows: Sequence[int], tokens: mx.array, top_n: Sequence[int]) -> None:
        """logits: the raw [B, V] logits; rows: which rows want logprobs; tokens: [B] sampled ids."""
        self.rows = list(rows)
        self.top_n = list(top_n)
        index = mx.array(self.rows)
        raw = logits[index].astype(mx.float32)
        row_max = mx.max(raw, axis=-1, keepdims=True)
        # 2**y instead of exp: about twice as fast on MLX's CPU backend (see truncation.py).
        mass = mx.sum(mx.power(2.0, (raw - row_max) * LOG2E), axis=-1, keepdims=True)
        logprobs = raw - (row_max + mx.log(mass))
        self.sampled = mx.take_along_axis(logprobs, tokens[index][:, None].astype(mx.int32), axis=-1)[:, 0]
        n = max(self.top_n)
        self.top_ids: mx.array | None = None
        self.top_values: mx.array | None = None
        if n > 0:
            # argpartition finds the n best without sorting the vocabulary; the host orders those n.
            self.top_ids = mx.argpartition(-raw, kth=n - 1, axis=-1)[:, :n]
            self.top_values = mx.take_along_axis(logprobs, self.top_ids, axis=-1)

    def arrays(self) -> list[mx.array]:
        """What to evaluate together with the sampled tokens."""
        extra = [] if self.top_ids is None or self.top_values is None else [self.top_ids, self.top_values]
        return [self.sampled, *extra]

    def resolve(self, token_ids: Sequence[int], batch_size: int) -> list[TokenLogprob | None]:
        """One entry per batch row: None where the row did not ask for logprobs."""
        out: list[TokenLogprob | None] = [None] * batch_size
        sampled = np.array(self.sampled)
        ids = None if self.top_ids is None else np.array(self.top_ids)
        values = None if self.top_values is None else np.array(self.top_values)
        for j, row in enumerate(self.rows):
            top: list[tuple[int, float]] = []
            if ids is not None and values is not None and self.top_n[j] > 0:
                # Best first; the stable sort keeps argpartition's order among equal logprobs.
                order = np.argsort(-values[j], kind="stable")[: self.top_n[j]]
                top = [(int(ids[j, o]), float(values[j, o])) for o in order]
            out[row] = TokenLogprob(token_id=token_ids[row], logprob=float(sampled[j]), top=top)
        return out
