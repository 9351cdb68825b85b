"""Log-probabilities to report: vLLM V1's default, taken from the raw model logits."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from metalserve.executor.array_backend import Array, ArrayBackend
from metalserve.outputs import TokenLogprob

if TYPE_CHECKING:
    from metalserve.executor.input_batch import CachedRequestState
    from metalserve.executor.step_inputs import StepInputs


def _log_norm(be: ArrayBackend, raw: Array) -> Array:
    """[R, 1] log of each row's softmax denominator, so that a logprob is logit - log_norm."""
    row_max = be.xp.max(raw, axis=-1, keepdims=True)
    # Sum in the backend's fastest exponential base; the log turns it back into natural units.
    scale = 1.0 / math.log(be.log_base)
    shifted = raw - row_max
    mass = be.xp.sum(be.exp(shifted * scale if scale != 1.0 else shifted), axis=-1, keepdims=True)
    return row_max + be.ln(mass)


def _by_chunks(be: ArrayBackend, raw: Array, fn: Callable[[Array], Array]) -> Array:
    """fn over row chunks of the backend's size (temporaries stay in cache), joined again."""
    step = be.row_chunk or raw.shape[0]
    parts = [fn(raw[i : i + step]) for i in range(0, raw.shape[0], step)]
    return parts[0] if len(parts) == 1 else be.xp.concatenate(parts)


class PendingLogprobs:
    """Logprob arrays for some rows of a step (lazy on MLX); `resolve` makes TokenLogprobs after eval."""

    def __init__(
        self, be: ArrayBackend, logits: Array, rows: Sequence[int], tokens: Array, top_n: Sequence[int]
    ) -> None:
        """logits: the raw float32 [B, V] logits; rows: which rows want logprobs; tokens: [B] sampled ids."""
        xp = be.xp
        self.rows = list(rows)
        self.top_n = list(top_n)
        index = be.asarray(self.rows, "int64")
        raw = logits[index] if len(self.rows) < logits.shape[0] else logits
        log_norm = _by_chunks(be, raw, lambda part: _log_norm(be, part))  # logprob = logit - log_norm
        sampled_ids = tokens[index][:, None].astype(xp.int32)
        self.sampled = (xp.take_along_axis(raw, sampled_ids, axis=-1) - log_norm)[:, 0]
        n = min(max(self.top_n), raw.shape[-1])
        self.top_ids: Array | None = None
        self.top_values: Array | None = None
        if n > 0:
            # A partition finds the n best without sorting the vocabulary; the host orders those n.
            self.top_ids = _by_chunks(be, raw, lambda part: be.top_indices(part, n))
            self.top_values = xp.take_along_axis(raw, self.top_ids, axis=-1) - log_norm

    def arrays(self) -> list[Array]:
        """What to evaluate together with the sampled tokens."""
        extra = [] if self.top_ids is None else [self.top_ids, self.top_values]
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
                # Best first; the stable sort keeps the partition's order among equal logprobs.
                order = np.argsort(-values[j], kind="stable")[: self.top_n[j]]
                top = [(int(ids[j, o]), float(values[j, o])) for o in order]
            out[row] = TokenLogprob(token_id=token_ids[row], logprob=float(sampled[j]), top=top)
        return out


def prompt_logprobs(
    logits: Array, step: StepInputs, requests: Mapping[str, CachedRequestState]
) -> dict[str, tuple[int, list[TokenLogprob]]]:
    """The prompt tokens' logprobs of `step.prompt_rows` (sampling_params.prompt_logprobs), from the raw
    logits of those rows in order: (first position, entries) per request, each with its top-k."""
    be = ArrayBackend()
    targets: list[int] = []
    top_n: list[int] = []
    for rid, first, n in step.prompt_rows:
        state = requests[rid]
        targets += state.token_ids[first : first + n]
        top_n += [state.sampling_params.prompt_logprobs or 0] * n
    tokens = be.asarray(targets, "int32")
    pending = PendingLogprobs(be, logits.astype(be.xp.float32), range(len(targets)), tokens, top_n)
    raw = logits.astype(be.xp.float32)
    own = be.xp.take_along_axis(raw, tokens[:, None], axis=-1)
    ranks = be.xp.sum(raw > own, axis=-1) + 1  # vLLM reports each prompt token's rank
    be.evaluate(ranks, *pending.arrays())
    entries = pending.resolve(targets, len(targets))
    for entry, rank in zip(entries, np.array(ranks).tolist(), strict=True):
        if entry is not None:
            entry.rank = int(rank)
    out: dict[str, tuple[int, list[TokenLogprob]]] = {}
    i = 0
    for rid, first, n in step.prompt_rows:
        out[rid] = (first, [e for e in entries[i : i + n] if e is not None])
        i += n
    return out
