"""The grammar step of the sampler: every constrained row of the batch masked in one operation."""

from __future__ import annotations

from collections.abc import Sequence

from metalserve.executor.array_backend import Array, ArrayBackend
from metalserve.executor.sampling_metadata import SamplingRequest
from metalserve.structured.bitmask import BatchMasker
from metalserve.structured.state import GrammarState

_MASKER = BatchMasker()  # one per process: it owns llguidance's thread pool and a reused bitmask buffer


def apply_grammar_masks(
    be: ArrayBackend, logits: Array, requests: Sequence[SamplingRequest], rows: Sequence[int]
) -> Array:
    """Disallowed tokens of the grammar rows set to -inf; other rows are untouched."""
    states: list[GrammarState] = []
    for row in rows:
        request = requests[row]
        state: GrammarState = request.structured  # type: ignore[attr-defined]
        if state.num_seen != request.num_output_tokens:
            state.replay(request.output_token_ids)  # the matcher missed tokens: rebuild it from the output
        states.append(state)
    vocab = logits.shape[-1]
    bias = _MASKER.bias(states, states[0].vocab_size, vocab)
    return be.add_rows(logits, list(rows), bias)
