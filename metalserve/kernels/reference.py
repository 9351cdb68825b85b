"""The portable attention path, written with MLX ops: paged, variable-length, causal, GQA.

The contract every attention backend (this one, the Metal kernel) honours:

- `q`: `[total_q, Hq, D]`, the queries of all requests packed on one token axis, request by request.
- `k_pool`, `v_pool`: `[num_slots, Hkv, D]` with `num_slots = num_blocks * block_size`; slot
  `block_id * block_size + offset` holds one token's K (or V). Hq is a multiple of Hkv (GQA).
- `block_tables`: `[num_reqs, max_blocks]` int32, row i lists request i's blocks in order (padding: any id).
- `cu_seqlens_q`: `[num_reqs + 1]` int32, request i owns query rows `cu[i]:cu[i+1]`.
- `seq_lens`: `[num_reqs]` int32, request i's total KV length *including* this step's new tokens, so its
  queries sit at positions `seq_len - q_len ... seq_len - 1` and query at position p sees keys `0..p`.
- options: `sliding_window` (a query at p sees keys `> p - window`), `softcap` (scores become
  `softcap * tanh(scores / softcap)`), `sinks` (`[Hq]` logits of a virtual key with zero value).

Here decode requests (one query each) are batched into one attention call over their gathered pages,
and each prefill chunk runs as its own call: no request is padded to the longest query.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class AttentionOptions:
    scale: float
    sliding_window: int | None = None
    softcap: float | None = None
    sinks: mx.array | None = None  # [Hq]


@dataclass(frozen=True)
class DecodeGroup:
    """Requests with one query each, attended together over their pages padded to the longest."""

    q_start: int
    q_end: int
    kv_slots: mx.array  # [B, L] gather indices into the flat pools
    mask: mx.array | None  # [B, 1, 1, L] additive; None when every request has length L and no window


@dataclass(frozen=True)
class PrefillChunk:
    q_start: int
    q_end: int
    kv_slots: mx.array  # [L] gather indices
    mask: mx.array | str  # "causal" or an additive [q_len, L] mask (sliding window)


@dataclass(frozen=True)
class AttentionPlan:
    """Host-side plan of one step's attention, built once and shared by every layer."""

    decode: DecodeGroup | None
    prefills: tuple[PrefillChunk, ...]


def _slots(block_row: np.ndarray, length: int, block_size: int) -> np.ndarray:
    """Slot of each position `0..length-1`; positions past the row's pages reuse its last page (masked)."""
    positions = np.arange(length)
    pages = np.minimum(positions // block_size, len(block_row) - 1)
    return np.asarray(block_row)[pages] * block_size + positions % block_size


def _window_mask(q_positions: np.ndarray, length: int, window: int | None) -> np.ndarray:
    """Additive mask: causal, and a sliding window when one is given."""
    keys = np.arange(length)[None, :]
    q = q_positions[:, None]
    allowed = keys <= q
    if window is not None:
        allowed &= keys > q - window
    return np.where(allowed, 0.0, -np.inf).astype(np.float32)


def _decode_group(
    block_tables: Sequence[np.ndarray] | np.ndarray, lens: np.ndarray, block_size: int, window: int | None
) -> DecodeGroup:
    longest = int(lens.max())
    slots = np.stack([_slots(block_tables[i], longest, block_size) for i in range(len(lens))])
    mask = None
    if window is not None or int(lens.min()) != longest:
        rows = [_window_mask(np.array([n - 1]), longest, window) for n in lens]
        mask = mx.array(np.stack(rows)[:, None, :, :])
    return DecodeGroup(0, len(lens), mx.array(slots.astype(np.int32)), mask)


def _prefill_chunk(
    block_row: np.ndarray, start: int, end: int, length: int, block_size: int, window: int | None
) -> PrefillChunk:
    slots = mx.array(_slots(block_row, length, block_size).astype(np.int32))
    mask: mx.array | str = "causal"
    if window is not None:
        mask = mx.array(_window_mask(np.arange(length - (end - start), length), length, window))
    return PrefillChunk(start, end, slots, mask)


def build_plan(
    block_tables: Sequence[np.ndarray] | np.ndarray,
    cu_seqlens_q: np.ndarray,
    seq_lens: np.ndarray,
    block_size: int,
    sliding_window: int | None = None,
) -> AttentionPlan:
    """Group the step's requests: leading single-query requests form the decode group.

    `block_tables` rows may be ragged (each request's own block ids) or a padded 2-D array.
    """
    num_reqs = len(seq_lens)
    q_lens = np.diff(cu_seqlens_q)
    num_decodes = 0
    while num_decodes < num_reqs and q_lens[num_decodes] == 1:
        num_decodes += 1
    decode = _decode_group(block_tables, seq_lens[:num_decodes], block_size, sliding_window) if num_decodes else None
    prefills = [
        _prefill_chunk(block_tables[i], int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]), int(seq_lens[i]),
                       block_size, sliding_window)
        for i in range(num_decodes, num_reqs)
    ]  # fmt: skip
    return AttentionPlan(decode, tuple(prefills))


def _attend(q: mx.array, k: mx.array, v: mx.array, mask: mx.array | str | None, opts: AttentionOptions) -> mx.array:
    """q: [B, Hq, Tq, D]; k, v: [B, Hkv, L, D]."""
    if isinstance(mask, mx.array) and mask.dtype != q.dtype:
        mask = mask.astype(q.dtype)  # the fused op wants an additive mask in the queries' dtype
    if opts.softcap is None:
        sinks = None if opts.sinks is None else opts.sinks.astype(q.dtype)
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=opts.scale, mask=mask, sinks=sinks)
    # Soft-capping happens between the scores and the softmax, which the fused op cannot do.
    b, hq, tq, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    qg = q.reshape(b, hkv, hq // hkv, tq, d)
    scores = (qg * opts.scale) @ k[:, :, None].swapaxes(-1, -2)
    scores = mx.tanh(scores.astype(mx.float32) / opts.softcap) * opts.softcap
    if isinstance(mask, str):
        offset = length - tq
        allowed = mx.arange(length)[None, :] <= (mx.arange(tq)[:, None] + offset)
        scores = mx.where(allowed, scores, -mx.inf)
    elif mask is not None:
        scores = scores + mask.reshape(mask.shape[0], 1, 1, *mask.shape[-2:])
    if opts.sinks is not None:
        sink = mx.broadcast_to(
            opts.sinks.reshape(1, hkv, hq // hkv, 1, 1).astype(mx.float32), (b, hkv, hq // hkv, tq, 1)
        )
        scores = mx.concatenate([sink, scores], axis=-1)
        probs = mx.softmax(scores, axis=-1)[..., 1:]
    else:
        probs = mx.softmax(scores, axis=-1)
    out = probs.astype(v.dtype) @ v[:, :, None]
    return out.reshape(b, hq, tq, d)


def paged_attention_planned(
    q: mx.array, k_pool: mx.array, v_pool: mx.array, plan: AttentionPlan, opts: AttentionOptions
) -> mx.array:
    """Attention for one layer following a prebuilt plan. Returns `[total_q, Hq, D]`."""
    parts = []
    if plan.decode is not None:
        g = plan.decode
        b, length = g.kv_slots.shape
        k = k_pool[g.kv_slots].transpose(0, 2, 1, 3)  # [B, Hkv, L, D]
        v = v_pool[g.kv_slots].transpose(0, 2, 1, 3)
        qd = q[g.q_start : g.q_end][:, :, None, :]  # [B, Hq, 1, D]
        parts.append(_attend(qd, k, v, g.mask, opts)[:, :, 0, :])
    for c in plan.prefills:
        k = k_pool[c.kv_slots].transpose(1, 0, 2)[None]  # [1, Hkv, L, D]
        v = v_pool[c.kv_slots].transpose(1, 0, 2)[None]
        qp = q[c.q_start : c.q_end].transpose(1, 0, 2)[None]  # [1, Hq, Tq, D]
        mask = c.mask if isinstance(c.mask, str) else c.mask[None, None]
        parts.append(_attend(qp, k, v, mask, opts)[0].transpose(1, 0, 2))
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)


def paged_attention(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    cu_seqlens_q: mx.array,
    seq_lens: mx.array,
    *,
    block_size: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """The backend contract's entry point (see the module docstring), planned on the host each call.

    Requests may come in any order; each runs as its own chunk, so this is the simple, slow form that
    tests use. The runner builds one plan per step with `build_plan` and calls `paged_attention_planned`.
    """
    bt, cu, lens = np.array(block_tables), np.array(cu_seqlens_q), np.array(seq_lens)
    chunks = [
        _prefill_chunk(bt[i], int(cu[i]), int(cu[i + 1]), int(lens[i]), block_size, sliding_window)
        for i in range(len(lens))
    ]
    plan = AttentionPlan(None, tuple(chunks))
    return paged_attention_planned(q, k_pool, v_pool, plan, AttentionOptions(scale, sliding_window, softcap, sinks))


def write_kv(
    k_pool: mx.array, v_pool: mx.array, k: mx.array, v: mx.array, slot_mapping: mx.array
) -> tuple[mx.array, mx.array]:
    """Scatter new K/V `[T, Hkv, D]` into the flat pools at `slot_mapping` `[T]`.

    The scatter's output takes over the pool's buffer when nothing else holds the old pool, so a step
    costs O(T), not O(pool): callers must drop their reference to the old pools (assign the result).
    """
    k_pool[slot_mapping] = k.astype(k_pool.dtype)
    v_pool[slot_mapping] = v.astype(v_pool.dtype)
    return k_pool, v_pool
