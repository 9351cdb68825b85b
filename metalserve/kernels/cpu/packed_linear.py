"""`x @ w.T` for rows of `x`, reading `w` in its packed codes (packed_codes.py), compiled with numba.

Decoding on the CPU is bound by reading the weights: fp32 costs four bytes a weight, the packed codes
half a byte (4 bits) to one (8 bits), plus a scale and offset per group. Every four output rows are
unpacked once into a scratch tile in L1 and then dotted with the input rows four at a time (sixteen
accumulators share each load of the tile and of the input), so the same kernel serves a decode step and a
prefill chunk: the unpacking is paid once per four output rows whatever the number of input rows.

A projection is a list of row blocks ("segments"), each packed its own way: a GGUF's fused q/k/v may
mix 4-bit q and k with a 6-bit v, and its layers may differ. `Segments` holds one list per projection
and layer range, the arrays shared with the codes they came from (no copy).
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np
from numba.typed import List

from metalserve.kernels.cpu.affine_linear import _four_rows, _one_row, _two_rows
from metalserve.kernels.cpu.numba_lock import launch_lock
from metalserve.kernels.cpu.packed_codes import PackedCodes


class Segments(NamedTuple):
    """Row blocks of one projection in several layers: segment `s` is `data[s]` (its codes, flat),
    `scales[s]`/`biases[s]` (flat), `rows[s]` outputs at `out_at[s]`, `bits[s]`; the segments of layer
    `l` are `layer_first[l]` to `layer_first[l + 1]`. `bias` `[L, out]`: the projection's own bias."""

    data: List
    scales: List
    biases: List
    rows: np.ndarray
    bits: np.ndarray
    out_at: np.ndarray
    layer_first: np.ndarray
    bias: np.ndarray
    columns: int


def segments_of(layers: list[list[PackedCodes]], bias: np.ndarray | None = None) -> Segments:
    """The segments of a projection whose layer `l` stacks `layers[l]`'s parts row-wise."""
    data, scales, biases = List(), List(), List()
    rows, bits, out_at, layer_first = [], [], [], [0]
    for parts in layers:
        at = 0
        for part in parts:
            data.append(np.ascontiguousarray(part.codes).reshape(-1))
            scales.append(np.ascontiguousarray(part.scales).reshape(-1))
            biases.append(np.ascontiguousarray(part.biases).reshape(-1))
            rows.append(part.shape[0])
            bits.append(part.bits)
            out_at.append(at)
            at += part.shape[0]
        layer_first.append(len(rows))
    outputs = sum(p.shape[0] for p in layers[0])
    if bias is None:
        bias = np.zeros((len(layers), outputs), np.float32)
    columns = layers[0][0].columns
    ints = (np.array(v, np.int64) for v in (rows, bits, out_at, layer_first))
    return Segments(data, scales, biases, *ints, np.ascontiguousarray(bias, np.float32), columns)


@numba.njit(fastmath=True, cache=True, nogil=True, boundscheck=False)
def unpack_row(data, scales, biases, row, bits, columns, groups, w, j):  # noqa: ANN001, ANN202
    """`w[j, :]` = the fp32 weights of row `row` of a packed segment (flat `data`, `scales`, `biases`)."""
    gs = columns // groups
    tail_bytes = 0 if bits == 8 else (bits - 4) * 4  # per 32 columns
    per_row = columns if bits == 8 else columns // 2 + (columns // 32) * tail_bytes
    at = row * per_row
    tail = at + columns // 2
    sat = row * groups
    for b in range(columns // 32):
        base = 32 * b
        s0 = scales[sat + base // gs]
        m0 = biases[sat + base // gs]
        s1 = scales[sat + (base + 16) // gs]
        m1 = biases[sat + (base + 16) // gs]
        if bits == 8:
            for k in range(16):
                w[j, base + k] = s0 * np.float32(data[at + base + k]) + m0
                w[j, base + 16 + k] = s1 * np.float32(data[at + base + 16 + k]) + m1
            continue
        p = at + 16 * b
        if bits == 4:
            for k in range(16):
                byte = np.int32(data[p + k])
                w[j, base + k] = s0 * np.float32(byte & 15) + m0
                w[j, base + 16 + k] = s1 * np.float32(byte >> 4) + m1
        elif bits == 5:
            h = tail + 4 * b
            word = (
                np.int64(data[h])
                | (np.int64(data[h + 1]) << 8)
                | (np.int64(data[h + 2]) << 16)
                | (np.int64(data[h + 3]) << 24)
            )
            for k in range(16):
                byte = np.int64(data[p + k])
                low = (byte & 15) | (((word >> k) & 1) << 4)
                high = (byte >> 4) | (((word >> (k + 16)) & 1) << 4)
                w[j, base + k] = s0 * np.float32(low) + m0
                w[j, base + 16 + k] = s1 * np.float32(high) + m1
        else:
            h = tail + 8 * b
            for k in range(16):
                byte = np.int32(data[p + k])
                two = np.int32(data[h + (k & 7)])
                shift = 2 * (k >> 3)
                low = (byte & 15) | (((two >> shift) & 3) << 4)
                high = (byte >> 4) | (((two >> (shift + 4)) & 3) << 4)
                w[j, base + k] = s0 * np.float32(low) + m0
                w[j, base + 16 + k] = s1 * np.float32(high) + m1


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True, boundscheck=False)
def segments_linear_kernel(x, seg, layer, chunks, out):  # noqa: ANN001, ANN202
    """`out[:, :] = x @ w.T + bias` for layer `layer` of `seg` (see Segments)."""
    rows = x.shape[0]
    columns = seg.columns
    first, last = seg.layer_first[layer], seg.layer_first[layer + 1]
    quads = 0
    for s in range(first, last):
        quads += (seg.rows[s] + 3) // 4
    per_chunk = (quads + chunks - 1) // chunks
    for c in numba.prange(chunks):
        w = np.empty((4, columns), np.float32)
        s = first
        skipped = 0  # quads of the segments before `s`
        for quad in range(c * per_chunk, min(quads, (c + 1) * per_chunk)):
            while quad - skipped >= (seg.rows[s] + 3) // 4:
                skipped += (seg.rows[s] + 3) // 4
                s += 1
            outputs = seg.rows[s]
            data, scales, biases = seg.data[s], seg.scales[s], seg.biases[s]
            groups = scales.shape[0] // outputs
            local = 4 * (quad - skipped)
            for j in range(4):
                unpack_row(data, scales, biases, min(local + j, outputs - 1), seg.bits[s], columns, groups, w, j)
            at = seg.out_at[s]
            r = 0
            while r + 4 <= rows:
                _four_rows(x, r, w, out, at + local, at + outputs)
                r += 4
            if r + 2 <= rows:
                _two_rows(x, r, w, out, at + local, at + outputs)
                r += 2
            if r < rows:
                _one_row(x, r, w, out, at + local, at + outputs)
    bias = seg.bias[layer]
    for t in range(rows):
        for o in range(out.shape[1]):
            out[t, o] += bias[o]


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True, boundscheck=False)
def gather_rows_kernel(data, scales, biases, bits, columns, groups, ids, out):  # noqa: ANN001, ANN202
    """`out[t] = row ids[t]` of one packed segment, in fp32 (an embedding lookup)."""
    for t in numba.prange(ids.shape[0]):
        unpack_row(data, scales, biases, ids[t], bits, columns, groups, out, t)


def packed_linear(x: np.ndarray, segments: Segments, layer: int = 0) -> np.ndarray:
    """`x` `[T, in]` float32 -> `x @ w.T + bias` `[T, out]` for layer `layer` of `segments`."""
    if x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != segments.columns:
        raise ValueError(f"packed_linear takes [T, {segments.columns}] float32, got {x.shape} {x.dtype}")
    out = np.zeros((x.shape[0], segments.bias.shape[1]), np.float32)
    with launch_lock:
        # Several chunks per thread even out a core that is busy with something else.
        chunks = numba.get_num_threads() * 8
        segments_linear_kernel(np.ascontiguousarray(x), segments, layer, chunks, out)
    return out


def gather_rows(codes: PackedCodes, ids: np.ndarray) -> np.ndarray:
    """The fp32 rows `ids` of `codes` `[len(ids), columns]` (an embedding lookup from the codes)."""
    ids = np.ascontiguousarray(ids, np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= codes.shape[0]):
        raise ValueError(f"row ids must lie in [0, {codes.shape[0]})")
    out = np.empty((ids.size, codes.columns), np.float32)
    flat = (np.ascontiguousarray(a).reshape(-1) for a in (codes.codes, codes.scales, codes.biases))
    with launch_lock:
        gather_rows_kernel(*flat, codes.bits, codes.columns, codes.scales.shape[1], ids, out)
    return out
