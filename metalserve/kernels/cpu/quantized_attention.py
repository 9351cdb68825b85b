"""The numba attention kernel over int8 / q4 KV pages (--kv-cache-dtype, formats in kv_quant.py).

A work item is a tile of up to `TILE_ROWS` consecutive query rows of one request and one KV head: it
dequantizes the keys and values the tile reads once, into its own float32 buffers, then runs the float
kernel's score / softmax / value loops for each row of the tile over them. Dequantizing per query row
instead (the kernel before this one, kept as bench/rowwise_quantized_attention.py) cost O(T^2 D) for
a prefill chunk of T rows over O(T D) data: at 4k context a 512-row chunk spent most of its time
decoding the same pages again. A decode row is a tile of one, as before: its pages are decoded into a
buffer that stays in cache while it is read, which a per-request scratch written in full and read back
afterwards (tried first) lost to by 1.4-2x at 8 decodes over 4k.

Memory: each running item holds one tile's span of one head (context x D x 2 floats), never
total_q x context.
"""

from __future__ import annotations

import numba
import numpy as np

from metalserve.kernels.cpu.attention import _scores, _softmax_rows, _weighted_values
from metalserve.kernels.cpu.int8_dot import half_to_float
from metalserve.kernels.cpu.numba_lock import launch_lock
from metalserve.kernels.cpu.work_split import short_long

# Rows per tile: decoding a tile's span costs about 1 / (2 x TILE_ROWS x group) of its attention, while
# a 512-row chunk still makes 32 tiles per KV head to share out.
TILE_ROWS = 16


@numba.njit(fastmath=True, cache=True, nogil=True)
def _half(bits):  # noqa: ANN001, ANN202  (numba infers the types)
    """A float16 given as its uint16 bits, as float32 (numba has no float16): the page scales. The
    conversion packed codes' scales take (half_to_float); exponent 31 reads as an infinity, NaN's bits too."""
    b = np.uint16(bits)
    if b & 0x7C00 == 0x7C00:
        return np.float32(-np.inf) if b & 0x8000 else np.float32(np.inf)
    return half_to_float(b)


@numba.njit(fastmath=True, cache=True, nogil=True)
def _dequantize_slots(codes, scales, biases, q4, slots, out):  # noqa: ANN001, ANN202
    """out[j] = the float32 vector in slot slots[j] of one plane and head (kv_quant.py's formats)."""
    dim = out.shape[1]
    if q4:
        groups = scales.shape[1]
        group_bytes = dim // groups // 2
        for j in range(slots.shape[0]):
            s = slots[j]
            for g in range(groups):
                scale, bias = _half(scales[s, g]), _half(biases[s, g])
                # a loop over the group's bytes from 0, not over channels (c // 2) nor from g * group_bytes:
                # only this form vectorises, 0.3 ns a value against 0.85-0.96
                b0 = g * group_bytes
                for b in range(group_bytes):
                    byte = codes[s, b0 + b]
                    out[j, 2 * (b0 + b)] = np.float32(byte & 0xF) * scale + bias
                    out[j, 2 * (b0 + b) + 1] = np.float32(byte >> 4) * scale + bias
    else:
        for j in range(slots.shape[0]):
            s = slots[j]
            scale = _half(scales[s, 0])
            for c in range(dim):
                out[j, c] = np.float32(codes[s, c]) * scale


@numba.njit(fastmath=True, cache=True, nogil=True)
def _page_slots(table_row, first, n, block_size):  # noqa: ANN001, ANN202
    """The pool slots of positions first .. first + n - 1, stepping through the blocks."""
    slots = np.empty(n, np.int64)
    block, offset = first // block_size, first % block_size
    for j in range(n):
        slots[j] = table_row[block] * block_size + offset
        offset += 1
        if offset == block_size:
            block, offset = block + 1, 0
    return slots


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _tiled_quantized_kernel(  # numba infers the types
    q,
    codes,
    scales,
    biases,
    q4,
    block_tables,
    order,
    tile_starts,
    row_req,
    row_pos,
    block_size,
    scale,
    window,
    softcap,
    sinks,
    use_sinks,
    out,
):
    """Rows order[tile_starts[t] : tile_starts[t + 1]] (one request's) attend their pages, KV head by KV head."""
    num_q_heads, num_kv_heads, dim = q.shape[1], codes.shape[1], q.shape[2]
    group = num_q_heads // num_kv_heads
    num_tiles = tile_starts.shape[0] - 1
    items = num_tiles * num_kv_heads
    for k in numba.prange(items):
        idx = short_long(k, items)  # rows sorted short to long
        tile, h = idx // num_kv_heads, idx % num_kv_heads
        begin, end = tile_starts[tile], tile_starts[tile + 1]
        r = row_req[order[begin]]
        low = high = row_pos[order[begin]]
        for i in range(begin + 1, end):
            low, high = min(low, row_pos[order[i]]), max(high, row_pos[order[i]])
        lo = max(0, low + 1 - window) if window > 0 else 0  # the earliest row reads from the lowest key
        span = high + 1 - lo
        slots = _page_slots(block_tables[r], lo, span, block_size)
        keys = np.empty((span, dim), np.float32)
        values = np.empty((span, dim), np.float32)
        _dequantize_slots(codes[0, h], scales[0, h], biases[0, h], q4, slots, keys)
        _dequantize_slots(codes[1, h], scales[1, h], biases[1, h], q4, slots, values)
        tops = np.empty(group, np.float32)
        for i in range(begin, end):
            row, last = order[i], row_pos[order[i]]
            first = max(0, last + 1 - window) if window > 0 else 0
            n = last + 1 - first
            local = np.arange(n) + (first - lo)
            scores = np.empty((group, n), np.float32)
            pow2 = np.empty(n, np.int32)
            _scores(q[row], keys, local, h * group, scores)
            _softmax_rows(scores, n, scale, softcap, sinks, use_sinks, h * group, pow2, tops)
            _weighted_values(scores, values, local, out[row, h * group : (h + 1) * group])


def row_tiles(row_req: np.ndarray, tile_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows in request order, tile starts into it with the end appended): each tile is up to `tile_rows`
    consecutive rows of one request."""
    order = np.argsort(row_req, kind="stable")
    owners = row_req[order]
    new_request = np.ones(len(order), bool)
    new_request[1:] = owners[1:] != owners[:-1]
    request_start = np.maximum.accumulate(np.where(new_request, np.arange(len(order)), 0))
    starts = np.flatnonzero((np.arange(len(order)) - request_start) % tile_rows == 0)
    return order.astype(np.int64), np.append(starts, len(order)).astype(np.int64)


def attend_quantized_rows(
    q: np.ndarray,
    codes: np.ndarray,
    scales: np.ndarray,
    biases: np.ndarray | None,
    block_tables: np.ndarray,
    row_req: np.ndarray,
    row_pos: np.ndarray,
    *,
    block_size: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: np.ndarray | None = None,
    tile_rows: int = TILE_ROWS,
) -> np.ndarray:
    """`attention.attend_rows` over int8 or q4 pages (kernels/cpu/kv_quant.py): `codes`
    `[2, Hkv, slots, D or D/2]`, `scales` (and q4's `biases`) `[2, Hkv, slots, groups]` float16."""
    if q.dtype != np.float32:
        raise TypeError(f"the CPU attention kernel takes float32 queries, got {q.dtype}")
    num_q_heads = q.shape[1]
    if num_q_heads % codes.shape[1]:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {codes.shape[1]} KV heads")
    q4 = codes.dtype == np.uint8
    half = scales.view(np.uint16)
    bias_bits = biases.view(np.uint16) if biases is not None else half
    row_req, row_pos = np.asarray(row_req, np.int32), np.asarray(row_pos, np.int32)
    order, tile_starts = row_tiles(row_req, tile_rows)
    out = np.empty(q.shape, np.float32)
    sink_logits = np.zeros(num_q_heads, np.float32) if sinks is None else np.ascontiguousarray(sinks, np.float32)
    with launch_lock:
        _tiled_quantized_kernel(
            np.ascontiguousarray(q),
            codes,
            half,
            bias_bits,
            q4,
            np.ascontiguousarray(block_tables, np.int32),
            order,
            tile_starts,
            row_req,
            row_pos,
            block_size,
            np.float32(scale),
            sliding_window or 0,
            np.float32(softcap or 0.0),
            sink_logits,
            sinks is not None,
            out,
        )
    return out
