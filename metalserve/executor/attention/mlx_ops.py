"""Paged attention written with MLX ops: the plan of a step, the K/V writes and the attention itself.

The ops behind the `mlx` backend (mlx.py, which owns the cache and the seam) and the Metal backend's
fallback; they honour the contract in base.py on any device and dtype.

The runner's pools for this path use the portable layout (base.py; `PortableKV` in mlx.py): a step's
decode requests (one query each) then gather all their pages in one op and attend in one call with the
KV heads folded into the batch, so no K/V is transposed; each prefill chunk runs as its own call. No
request is padded to the longest query. `paged_attention`, the contract's entry point, takes the
contract's pools and converts them (tests use it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from metalserve.executor.attention.base import AttentionOptions
from metalserve.executor.attention.kv_quant import KVPool, QuantPool, SplitPool, take_slots


@dataclass(frozen=True)
class DecodeGroup:
    """Requests with one query each, attended together over their pages padded to the longest."""

    q_start: int
    q_end: int
    block_ids: mx.array  # [B, n] each request's pages, padded with its last page (masked)
    block_size: int
    mask: mx.array | None  # [Hkv * B, 1, 1, n * block_size] additive; None when nothing is masked


@dataclass(frozen=True)
class PrefillChunk:
    q_start: int
    q_end: int
    kv_slots: mx.array  # [L] gather indices
    mask: mx.array | str  # "causal" or an additive [q_len, L] mask (sliding window)


@dataclass(frozen=True)
class AttentionPlan:
    """Host-side plan of one step's attention, built once and shared by every layer."""

    decodes: tuple[DecodeGroup, ...]  # single-query requests, in buckets of similar length
    prefills: tuple[PrefillChunk, ...]


def _slots(block_row: np.ndarray, length: int, block_size: int) -> np.ndarray:
    """Slot of each position `0..length-1`; positions past the row's pages reuse its last page (masked)."""
    positions = np.arange(length)
    pages = np.minimum(positions // block_size, len(block_row) - 1)
    return np.asarray(block_row)[pages] * block_size + positions % block_size


def _window_mask(
    q_positions: np.ndarray,
    length: int,
    window: int | None,
    key_start: int = 0,
    spans: Sequence[tuple[int, int]] = (),
) -> np.ndarray:
    """Additive mask over keys `key_start .. length - 1`: causal, and a sliding window when one is given.
    `spans`: images whose tokens also see each other both ways, whatever the window (HF's Gemma 3 ORs
    this onto the causal and the sliding masks)."""
    keys = np.arange(key_start, length)[None, :]
    q = q_positions[:, None]
    allowed = keys <= q
    if window is not None:
        allowed &= keys > q - window
    for start, end in spans:
        allowed |= (q >= start) & (q < end) & (keys >= start) & (keys < end)
    return np.where(allowed, 0.0, -np.inf).astype(np.float32)


def _decode_group(
    block_tables: Sequence[np.ndarray] | np.ndarray,
    start: int,
    lens: np.ndarray,
    block_size: int,
    window: int | None,
    num_kv_heads: int,
) -> DecodeGroup:
    """Requests `start .. start + len(lens)`, one query each, padded to the longest of them. With a
    window, each request's pages start at the first one its window reads (the rest are never gathered)."""
    first = np.zeros(len(lens), np.int64) if window is None else np.maximum(lens - window, 0) // block_size
    pages = int(((lens - 1) // block_size - first).max()) + 1
    tables = [np.asarray(block_tables[start + i]) for i in range(len(lens))]
    rows = [t[np.minimum(f + np.arange(pages), len(t) - 1)] for t, f in zip(tables, first, strict=True)]
    mask = None
    span = pages * block_size
    if window is not None or int(lens.min()) != span:
        masks = np.stack(
            [
                _window_mask(np.array([n - 1]), int(f) * block_size + span, window, int(f) * block_size)
                for n, f in zip(lens, first, strict=True)
            ]
        )[:, None]  # [B, 1, 1, L]
        mask = mx.array(np.tile(masks, (num_kv_heads, 1, 1, 1)))  # batch rows are (kv head, request)
    return DecodeGroup(start, start + len(lens), mx.array(np.stack(rows).astype(np.int32)), block_size, mask)


def _prefill_chunk(
    block_row: np.ndarray,
    start: int,
    end: int,
    length: int,
    block_size: int,
    window: int | None,
    spans: Sequence[tuple[int, int]] = (),
) -> PrefillChunk:
    q_first = length - (end - start)
    # With a window, keys start at the page of the first query's oldest key: no page behind it is read
    # (an image's tokens read their whole image, so keys start no later than its first).
    oldest = min([max(0, q_first - window + 1), *(s for s, _ in spans)]) if window is not None else 0
    key_start = oldest // block_size * block_size
    slots = mx.array(_slots(block_row, length, block_size)[key_start:].astype(np.int32))
    mask: mx.array | str = "causal"
    if window is not None or spans:
        mask = mx.array(_window_mask(np.arange(q_first, length), length, window, key_start, spans))
    return PrefillChunk(start, end, slots, mask)


def build_plan(
    block_tables: Sequence[np.ndarray] | np.ndarray,
    cu_seqlens_q: np.ndarray,
    seq_lens: np.ndarray,
    block_size: int,
    sliding_window: int | None = None,
    num_kv_heads: int = 1,
    image_spans: dict[int, list[tuple[int, int]]] | None = None,
) -> AttentionPlan:
    """Group the step's requests: leading single-query requests form the decode group. `image_spans`:
    request row -> its images' positions, attended both ways within each image (StepInputs.image_spans);
    a single query needs nothing (it sees every earlier key already).

    `block_tables` rows may be ragged (each request's own block ids) or a padded 2-D array.
    """
    num_reqs = len(seq_lens)
    q_lens = np.diff(cu_seqlens_q)
    num_decodes = 0
    while num_decodes < num_reqs and q_lens[num_decodes] == 1:
        num_decodes += 1
    decodes = tuple(
        _decode_group(block_tables, a, seq_lens[a:b], block_size, sliding_window, num_kv_heads)
        for a, b in _length_buckets(seq_lens[:num_decodes], block_size)
    )
    prefills = [
        _prefill_chunk(
            block_tables[i],
            int(cu_seqlens_q[i]),
            int(cu_seqlens_q[i + 1]),
            int(seq_lens[i]),
            block_size,
            sliding_window,
            (image_spans or {}).get(i, ()),
        )
        for i in range(num_decodes, num_reqs)
    ]
    return AttentionPlan(decodes, tuple(prefills))


def _length_buckets(lens: np.ndarray, block_size: int) -> list[tuple[int, int]]:
    """Split consecutive decodes where padding to the group's longest would more than double a request's
    pages: one long context must not make every short one attend over its length (callers sort by length)."""
    buckets, start = [], 0
    for i in range(1, len(lens) + 1):
        if i == len(lens) or -(-int(lens[i]) // block_size) > 2 * -(-int(lens[start]) // block_size) + 1:
            buckets.append((start, i))
            start = i
    return buckets


def _attend(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    mask: mx.array | str | None,
    opts: AttentionOptions,
    sinks: mx.array | None = None,
) -> mx.array:
    """q: [B, Hq, Tq, D]; k, v: [B, Hkv, L, D]. `sinks`: broadcastable to [B, Hkv, Hq // Hkv, Tq, 1]."""
    if isinstance(mask, mx.array) and mask.dtype != q.dtype:
        mask = mask.astype(q.dtype)  # the fused op wants an additive mask in the queries' dtype
    if opts.softcap is None and sinks is None:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=opts.scale, mask=mask)
    # Soft-capping and sinks act between the scores and the softmax: spelled out with plain ops.
    b, hq, tq, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    qg = q.reshape(b, hkv, hq // hkv, tq, d)
    scores = ((qg * opts.scale) @ k[:, :, None].swapaxes(-1, -2)).astype(mx.float32)
    if opts.softcap is not None:
        scores = mx.tanh(scores / opts.softcap) * opts.softcap
    if isinstance(mask, str):
        allowed = mx.arange(length)[None, :] <= (mx.arange(tq)[:, None] + length - tq)
        scores = mx.where(allowed, scores, -mx.inf)
    elif mask is not None:
        scores = scores + mask.reshape(mask.shape[0], 1, 1, *mask.shape[-2:]).astype(mx.float32)
    if sinks is not None:
        sink = mx.broadcast_to(sinks.astype(mx.float32), (b, hkv, hq // hkv, tq, 1))
        probs = mx.softmax(mx.concatenate([sink, scores], axis=-1), axis=-1)[..., 1:]
    else:
        probs = mx.softmax(scores, axis=-1)
    out = probs.astype(v.dtype) @ v[:, :, None]
    return out.reshape(b, hq, tq, d)


def _attend_decodes(q: mx.array, pool: KVPool, g: DecodeGroup, opts: AttentionOptions) -> mx.array:
    """One call for every single-query request: KV heads folded into the batch, `[Hkv * B, 1, L, D]`."""
    planes, hkv, num_slots, d = pool.shape
    b, pages = g.block_ids.shape
    if isinstance(pool, QuantPool | SplitPool):  # gather the pages' codes and scales, dequantize only those
        slots = (g.block_ids[:, :, None] * g.block_size + mx.arange(g.block_size)).reshape(b, pages * g.block_size)
        kv = pool.take(slots).reshape(planes, hkv * b, 1, pages * g.block_size, d)
    else:
        pages_view = pool.reshape(planes, hkv, num_slots // g.block_size, g.block_size, d)
        kv = pages_view[:, :, g.block_ids].reshape(planes, hkv * b, 1, pages * g.block_size, d)  # one gather
    hq = q.shape[1]
    group = hq // hkv
    qd = q[g.q_start : g.q_end].reshape(b, hkv, group, d).transpose(1, 0, 2, 3).reshape(hkv * b, group, 1, d)
    sinks = None
    if opts.sinks is not None:  # per query head: row (kv head h, request) uses sinks[h * group : (h + 1) * group]
        sinks = mx.broadcast_to(opts.sinks.reshape(hkv, 1, group), (hkv, b, group)).reshape(hkv * b, 1, group, 1, 1)
    out = _attend(qd, kv[0], kv[-1], g.mask, opts, sinks)  # [Hkv * B, group, 1, D]
    return out.reshape(hkv, b, group, d).transpose(1, 0, 2, 3).reshape(b, hq, d)


def paged_attention_planned(q: mx.array, pool: KVPool, plan: AttentionPlan, opts: AttentionOptions) -> mx.array:
    """Attention for one layer over the portable pool `[2, Hkv, num_slots, D]` (or its quantized form,
    kv_quant.QuantPool, dequantized as it is read). Returns `[total_q, Hq, D]`.

    A latent pool `[1, Hkv, num_slots, D]` (`opts.value_dim`) attends with K as its own V and keeps the
    output's first `value_dim` channels: the same numbers as a narrower V, with every reshape unchanged."""
    if (pool.shape[0] == 1) != (opts.value_dim is not None):
        raise ValueError(f"a pool of {pool.shape[0]} planes with value_dim {opts.value_dim}: K/V and latent mixed up")
    parts = []
    for group in plan.decodes:
        parts.append(_attend_decodes(q, pool, group, opts))
    hkv, hq = pool.shape[1], q.shape[1]
    sinks = None if opts.sinks is None else opts.sinks.reshape(1, hkv, hq // hkv, 1, 1)
    for c in plan.prefills:
        kv = take_slots(pool, c.kv_slots)[:, None]  # [2, 1, Hkv, L, D]
        qp = q[c.q_start : c.q_end].transpose(1, 0, 2)[None]  # [1, Hq, Tq, D]
        mask = c.mask if isinstance(c.mask, str) else c.mask[None, None]
        parts.append(_attend(qp, kv[0], kv[-1], mask, opts, sinks)[0].transpose(1, 0, 2))
    out = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
    return out if opts.value_dim is None else out[..., : opts.value_dim]


def portable_pool(k_pool: mx.array, v_pool: mx.array) -> mx.array:
    """The contract's slot-major pools `[num_slots, Hkv, D]` as one portable pool `[2, Hkv, num_slots, D]`."""
    return mx.stack([k_pool, v_pool]).transpose(0, 2, 1, 3)


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
    plan = AttentionPlan((), tuple(chunks))
    opts = AttentionOptions(scale, sliding_window, softcap, sinks)
    return paged_attention_planned(q, portable_pool(k_pool, v_pool), plan, opts)


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


def write_kv_portable(pool: mx.array, k: mx.array, v: mx.array | None, slot_mapping: mx.array) -> mx.array:
    """Scatter new K/V `[T, Hkv, D]` into the portable pool `[2, Hkv, num_slots, D]`; in place, as `write_kv`.
    `v` None: a latent pool `[1, Hkv, num_slots, D]` takes K alone."""
    kv = k[None] if v is None else mx.stack([k, v])
    if kv.shape[0] != pool.shape[0]:
        raise ValueError(f"a pool of {pool.shape[0]} planes cannot take {kv.shape[0]} (K and V, or the latent K)")
    pool[:, :, slot_mapping] = kv.astype(pool.dtype).transpose(0, 2, 1, 3)
    return pool
