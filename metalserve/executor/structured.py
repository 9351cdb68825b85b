"""The grammar step of the sampler: every constrained row of the batch masked in one operation."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from metalserve.executor.array_backend import Array, ArrayBackend
from metalserve.sampling_params import SamplingRequest
from metalserve.structured.bitmask import BatchMasker
from metalserve.structured.state import GrammarState

_MASKER = BatchMasker()  # one per process: it owns llguidance's thread pool and a reused bitmask buffer


def apply_grammar_masks(
    be: ArrayBackend, logits: Array, requests: Sequence[SamplingRequest], rows: Sequence[int]
) -> Array:
    """Disallowed tokens of the grammar rows set to -inf; other rows are untouched.

    A speculative window's rows carry their mask already (spec_decode/grammar.py: `bias`)."""
    states: list[GrammarState] = []
    live: list[int] = []
    fixed: list[int] = []
    for row in rows:
        request = requests[row]
        state = request.structured  # type: ignore[attr-defined]
        if getattr(state, "bias", None) is not None:
            fixed.append(row)
            continue
        if state.num_seen != request.num_output_tokens:
            state.replay(request.output_token_ids)  # the matcher missed tokens: rebuild it from the output
        states.append(state)
        live.append(row)
    vocab = logits.shape[-1]
    if not fixed:
        return be.add_rows(logits, list(rows), _MASKER.bias(states, states[0].vocab_size, vocab))
    by_row = dict(zip(live, _MASKER.bias(states, states[0].vocab_size, vocab), strict=True)) if states else {}
    by_row |= {row: requests[row].structured.bias for row in fixed}  # type: ignore[attr-defined]
    return be.add_rows(logits, list(rows), np.stack([by_row[row] for row in rows]))
