"""Packing one step: every scheduled token of every request on one token axis, decodes first."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


class PackedRequest(Protocol):
    """What packing reads of a request (the runner's CachedRequestState; the draft model's view of one)."""

    @property
    def token_ids(self) -> list[int]: ...
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def block_array(self) -> np.ndarray: ...
    @property
    def wants_prompt_logprobs(self) -> bool: ...
    @property
    def wants_pooling(self) -> bool: ...
    @property
    def mm_inputs(self) -> list[Any]: ...


@dataclass
class StepInputs:
    """Host-side arrays for one forward, in packed order."""

    request_ids: list[str]  # packed order: single-query requests first
    token_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T]
    cu_seqlens_q: np.ndarray  # [R + 1]
    seq_lens: np.ndarray  # [R]
    block_rows: list[np.ndarray]  # each request's block ids (ragged)
    sampling_rows: list[int]  # indices into request_ids of requests that sample this step
    logits_indices: np.ndarray  # [S] each sampling request's last query row (its whole window if drafted)
    # Requests that want prompt logprobs: (request id, first target position, rows), their rows' logits
    # following the sampling rows' in logits_indices (row j predicts prompt token `first + j`).
    prompt_rows: list[tuple[str, int, int]] = field(default_factory=list)
    # Request row -> the [start, end) positions of each of its images this step touches, whose tokens
    # attend to each other both ways (Gemma 3); empty for causal models.
    image_spans: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    # Indices into request_ids of pooling requests (sampling_params.pooling): they sample nothing; the
    # runner pools their rows' hidden states (executor/pooling.py).
    pooling_rows: list[int] = field(default_factory=list)

    @property
    def num_sampling_logits(self) -> int:
        return len(self.logits_indices) - sum(n for _, _, n in self.prompt_rows)

    def padded_block_tables(self) -> np.ndarray:
        width = max(len(r) for r in self.block_rows)
        table = np.zeros((len(self.block_rows), width), dtype=np.int32)
        for i, row in enumerate(self.block_rows):
            table[i, : len(row)] = row
        return table


def request_slots(table: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """Where the K/V of a request's tokens at `positions` goes through its `table` (its block ids in one
    layer group): slot `block * block_size + offset` of the position's block."""
    return table[positions // block_size] * block_size + positions % block_size


def table_slots(
    tables: Sequence[np.ndarray], positions: np.ndarray, cu_seqlens_q: np.ndarray, block_size: int
) -> np.ndarray:
    """`request_slots` of every packed request (`tables` in packed order), on the packed axis."""
    cu = cu_seqlens_q.tolist()
    parts = [request_slots(t, positions[cu[i] : cu[i + 1]], block_size) for i, t in enumerate(tables)]
    return np.concatenate(parts).astype(np.int32)


def pack_step(
    states: Mapping[str, PackedRequest],
    num_scheduled: dict[str, int],
    block_size: int,
    drafts: dict[str, list[int]] | None = None,
    bidirectional_images: bool = False,
) -> StepInputs:
    """Lay out the step: requests with one query first (they form the batched decode group), its slots
    and block rows through each request's `block_array` (the runner's first layer group; block_table.py
    gives the step through the other groups' tables).

    `drafts`: speculative tokens that follow a request's known tokens; its window (last token plus
    drafts) gets a logits row per query, so one forward verifies every draft."""
    drafts = drafts or {}
    image_spans: dict[int, list[tuple[int, int]]] = {}
    # Single-query requests first, shortest context first, so the attention can bucket them by length.
    order = sorted(
        num_scheduled,
        key=lambda rid: (num_scheduled[rid] != 1, states[rid].num_computed_tokens if num_scheduled[rid] == 1 else 0),
    )
    tokens, positions, slots, rows = [], [], [], []
    cu = [0]
    seq_lens: list[int] = []
    sampling_rows: list[int] = []
    logits_indices: list[int] = []
    prompt_rows: list[tuple[str, int, int]] = []
    prompt_indices: list[int] = []
    pooling_rows: list[int] = []
    for i, rid in enumerate(order):
        state, n = states[rid], num_scheduled[rid]
        start = state.num_computed_tokens
        end = start + n
        spec = drafts.get(rid, ())
        known = len(state.token_ids) + len(spec)
        if end > known:
            raise ValueError(f"request {rid}: scheduled past its known tokens ({end} > {known})")
        pos = np.arange(start, end)
        blocks = state.block_array
        if (end + block_size - 1) // block_size > len(blocks):
            raise ValueError(f"request {rid}: {len(blocks)} blocks cannot hold {end} tokens")
        tokens.append(state.token_ids[start:end] if not spec else state.token_ids[start:] + list(spec))
        positions.append(pos)
        slots.append(request_slots(blocks, pos, block_size))
        rows.append(blocks)
        cu.append(cu[-1] + n)
        seq_lens.append(end)
        if bidirectional_images and state.mm_inputs:
            spans = [(mm.offset, mm.offset + mm.length) for mm in state.mm_inputs if mm.offset < end]
            if any(e > start for _, e in spans):
                image_spans[i] = spans
        if state.wants_pooling:
            pooling_rows.append(i)
        elif end == known:  # caught up with every known token: sample the next one (and verify drafts)
            sampling_rows.append(i)
            logits_indices.extend(range(cu[-1] - 1 - len(spec), cu[-1]))
        if state.wants_prompt_logprobs:  # rows before the prompt's last predict prompt tokens
            last_row = min(end, state.num_prompt_tokens - 1)
            if start < last_row:
                prompt_rows.append((rid, start + 1, last_row - start))
                prompt_indices.extend(range(cu[-2], cu[-2] + last_row - start))
    return StepInputs(
        request_ids=order,
        token_ids=np.fromiter((t for chunk in tokens for t in chunk), dtype=np.int32),
        positions=np.concatenate(positions).astype(np.int32),
        slot_mapping=np.concatenate(slots).astype(np.int32),
        cu_seqlens_q=np.asarray(cu, dtype=np.int32),
        seq_lens=np.asarray(seq_lens, dtype=np.int32),
        block_rows=rows,
        sampling_rows=sampling_rows,
        logits_indices=np.asarray(logits_indices + prompt_indices, dtype=np.int32),
        prompt_rows=prompt_rows,
        image_spans=image_spans,
        pooling_rows=pooling_rows,
    )
