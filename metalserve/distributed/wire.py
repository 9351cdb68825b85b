"""The messages between ranks: a fixed-size header, then one payload (step metadata and activations).

Rank 0 sends each step's header + payload to rank 1; every middle rank forwards the metadata with its own
activations to the next; the last rank sends the header and the hidden rows that sample back to rank 0.
Each message is one `send` of a header (int32[HEADER_LEN]) and, when not empty, one of a uint8 payload.
"""

from __future__ import annotations

from enum import IntEnum
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from metalserve.executor.step_inputs import StepInputs

HEADER_LEN = 9


class Kind(IntEnum):
    STEP = 1  # header, then metadata + activations
    RESULT = 2  # last rank -> rank 0: header, then the sampling rows' hidden states
    STOP = 3  # orderly shutdown, passed down the pipeline


class Header(NamedTuple):
    kind: int
    num_tokens: int  # T
    num_requests: int  # R
    num_rows: int  # S: rows that sample
    table_width: int  # block-table width
    num_kv_blocks: int  # the pool size every rank must have for this step
    step_id: int
    payload_bytes: int
    num_tables: int = 1  # block tables per request: one per layer group of the model

    def array(self) -> mx.array:
        return mx.array(list(self), dtype=mx.int32)


class StepMeta(NamedTuple):
    """What a stage needs from a packed step: no token ids (rank 0 embeds), no request ids. The slots and
    `block_rows` are the packed group's (group 0); `group_rows` every other layer group's tables (sliding
    windows, recurrent states), from which each stage reads its layers' groups."""

    positions: np.ndarray
    slot_mapping: np.ndarray
    cu_seqlens_q: np.ndarray
    seq_lens: np.ndarray
    block_rows: list[np.ndarray]
    logits_indices: np.ndarray
    group_rows: tuple[list[np.ndarray], ...] = ()  # groups 1.. in spec order, each per request

    @classmethod
    def from_step(cls, step: StepInputs, group_rows: tuple[list[np.ndarray], ...] = ()) -> StepMeta:
        return cls(
            step.positions,
            step.slot_mapping,
            step.cu_seqlens_q,
            step.seq_lens,
            step.block_rows,
            step.logits_indices,
            group_rows,
        )

    def tables(self) -> list[list[np.ndarray]]:
        """Every layer group's block rows, group 0 first."""
        return [self.block_rows, *self.group_rows]

    def step_inputs(self, request_ids: list[str] | None = None) -> StepInputs:
        """A StepInputs for the attention backend's `build_metadata` (token ids left empty; request ids
        as given, else empty)."""
        r = len(self.seq_lens)
        return StepInputs(
            [""] * r if request_ids is None else request_ids,
            np.zeros(0, np.int32),
            self.positions,
            self.slot_mapping,
            self.cu_seqlens_q,
            self.seq_lens,
            self.block_rows,
            [],
            self.logits_indices,
        )

    def encode(self) -> tuple[np.ndarray, int]:
        """int32 vector: positions, slots, cu_seqlens, seq_lens, row lengths, padded table, logits rows,
        then each other group's row lengths and padded table (every table padded to one width)."""
        width = max((len(row) for rows in self.tables() for row in rows), default=0)
        parts = [self.positions, self.slot_mapping, self.cu_seqlens_q, self.seq_lens, *_padded(self.block_rows, width)]
        parts.append(self.logits_indices)
        for rows in self.group_rows:
            parts.extend(_padded(rows, width))
        return np.concatenate([np.asarray(p, np.int32) for p in parts]), width

    @classmethod
    def decode(cls, flat: np.ndarray, h: Header) -> StepMeta:
        t, r, s, w = h.num_tokens, h.num_requests, h.num_rows, h.table_width
        cuts = np.cumsum([t, t, r + 1, r, r, r * w, s] + [r, r * w] * (h.num_tables - 1))
        pos, slots, cu, seq, *tables = np.split(flat, cuts)
        rows, extra = tables[2], tables[3:-1]
        if len(rows) != s:
            raise ValueError(f"step metadata: {len(rows)} sampling rows, the header says {s}")
        groups = [_unpadded(tables[0], tables[1], r, w)]
        groups += [_unpadded(extra[k], extra[k + 1], r, w) for k in range(0, len(extra), 2)]
        return cls(pos, slots, cu, seq, groups[0], rows, tuple(groups[1:]))


def _padded(rows: list[np.ndarray], width: int) -> tuple[np.ndarray, np.ndarray]:
    """(each row's length, the rows as one zero-padded `[R, width]` table, flattened)."""
    table = np.zeros((len(rows), width), np.int32)
    for i, row in enumerate(rows):
        table[i, : len(row)] = row
    return np.fromiter((len(row) for row in rows), np.int32, len(rows)), table.ravel()


def _unpadded(lens: np.ndarray, flat: np.ndarray, r: int, w: int) -> list[np.ndarray]:
    table = flat.reshape(r, w)
    return [table[i, : lens[i]] for i in range(r)]


def pack_payload(meta_flat: np.ndarray | None, hidden: mx.array | None) -> mx.array | None:
    """One uint8 array: the int32 metadata, then the activations' bytes."""
    parts = []
    if meta_flat is not None and meta_flat.size:
        parts.append(mx.view(mx.array(meta_flat), mx.uint8))
    if hidden is not None and hidden.size:
        parts.append(mx.view(hidden.reshape(-1), mx.uint8))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)


def send_message(header: Header, payload: mx.array | None, dst: int, group: mx.distributed.Group) -> None:
    """Send the header, then the payload (its size is in the header); both evaluated before returning."""
    mx.eval(mx.distributed.send(header.array(), dst, group=group))
    if payload is not None:
        mx.eval(mx.distributed.send(payload, dst, group=group))


def recv_header(src: int, group: mx.distributed.Group) -> Header:
    arr = mx.distributed.recv((HEADER_LEN,), mx.int32, src, group=group)
    mx.eval(arr)
    values: list[int] = np.array(arr).tolist()
    return Header(*values)


def recv_payload(header: Header, src: int, group: mx.distributed.Group) -> mx.array | None:
    if header.payload_bytes == 0:
        return None
    arr = mx.distributed.recv((header.payload_bytes,), mx.uint8, src, group=group)
    mx.eval(arr)
    return arr


def meta_bytes(header: Header) -> int:
    t, r, s, w = header.num_tokens, header.num_requests, header.num_rows, header.table_width
    return 4 * (2 * t + (r + 1) + r + header.num_tables * (r + r * w) + s)


def split_payload(payload: mx.array | None, header: Header, with_meta: bool) -> tuple[np.ndarray | None, mx.array]:
    """(the metadata as int32 or None, the activations' raw bytes as uint8)."""
    if payload is None:
        return (np.zeros(0, np.int32) if with_meta else None), mx.zeros((0,), mx.uint8)
    cut = meta_bytes(header) if with_meta else 0
    meta = np.array(mx.view(payload[:cut], mx.int32)) if with_meta else None
    return meta, payload[cut:]


def as_hidden(raw: mx.array, rows: int, dtype: mx.Dtype) -> mx.array:
    """Raw activation bytes -> `[rows, hidden]` in the model's dtype."""
    if rows == 0:
        return mx.zeros((0, 1), dtype)
    return mx.view(raw, dtype).reshape(rows, -1)
