"""One row of packed codes (packed_codes.py) unpacked to fp32: the step every packed-codes kernel shares."""

from __future__ import annotations

import numba
import numpy as np

from metalserve.kernels.cpu.int8_dot import half_to_float


@numba.njit(fastmath=True, cache=True, nogil=True, boundscheck=False)
def _unpack_scaled(src, scales, biases, bits, size, out):  # noqa: ANN001, ANN202
    """8-bit codes, or 4-bit ones whose half-rows hold whole groups, straight into fp32 weights (offsets
    into the row, not a slice per group: a slice costs more than a group's 32 weights)."""
    if bits == 8:
        for g in range(scales.shape[0]):
            base = g * size
            s, m = half_to_float(scales[g]), half_to_float(biases[g])
            for k in range(size):
                out[base + k] = s * np.float32(src[base + k]) + m
        return
    lower = scales.shape[0] // 2  # groups in the low nibbles; the same bytes' high nibbles hold the rest
    for g in range(lower):
        base, top = g * size, (lower + g) * size
        s0, m0 = half_to_float(scales[g]), half_to_float(biases[g])
        s1, m1 = half_to_float(scales[lower + g]), half_to_float(biases[lower + g])
        for k in range(size):
            byte = np.int32(src[base + k])
            out[base + k] = s0 * np.float32(byte & 15) + m0
            out[top + k] = s1 * np.float32(byte >> 4) + m1


@numba.njit(fastmath=True, cache=True, nogil=True, boundscheck=False)
def unpack_row(data, scales, biases, row, bits, columns, groups, w, j):  # noqa: ANN001, ANN202
    """`w[j, :]` = the fp32 weights of row `row` of a packed segment (flat `data`, `scales`, `biases`).

    Contiguous loops LLVM vectorizes: 8- and 4-bit codes are scaled as they are unpacked; 5- and 6-bit
    ones are unpacked a bit plane at a time, then scaled. The loops index row slices taken once per row:
    indexing the flat arrays with a computed offset kept them scalar (ten times slower)."""
    half = columns // 2
    per_row = columns if bits == 8 else half + columns * (bits - 4) // 8
    src = data[row * per_row : (row + 1) * per_row]
    out = w[j]
    size = columns // groups
    row_scales = scales[row * groups : (row + 1) * groups]
    row_biases = biases[row * groups : (row + 1) * groups]
    if bits == 8 or (bits == 4 and half % size == 0):  # one pass: codes, scale and offset at once
        _unpack_scaled(src, row_scales, row_biases, bits, size, out)
        return
    # 5 and 6 bits (and 4 bits whose groups straddle the half-row): a plane of columns at a time, its
    # nibbles and its high bits together, then scaled.
    width = bits - 4
    planes = 8 // width if width else 2
    span = columns // planes
    for q in range(planes):
        start = (q % (planes // 2)) * span  # planes in the low nibbles first, then the high ones
        nibbles = src[start : start + span]
        highs = src[half : half + span]
        dest = out[q * span : (q + 1) * span]
        nibble_shift = 4 * (q // (planes // 2))
        if width:
            high_shift = width * q
            mask = (1 << width) - 1
            for i in range(span):
                nibble = (np.int32(nibbles[i]) >> nibble_shift) & 15
                high = (np.int32(highs[i]) >> high_shift) & mask
                dest[i] = np.float32(nibble | (high << 4))
        else:
            for i in range(span):
                dest[i] = np.float32((np.int32(nibbles[i]) >> nibble_shift) & 15)
    for g in range(groups):
        base = g * size
        s, m = half_to_float(row_scales[g]), half_to_float(row_biases[g])
        for k in range(size):
            out[base + k] = out[base + k] * s + m


@numba.njit(fastmath=True, cache=True, nogil=True, boundscheck=False)
def unpack_planes(codes2, scales2, biases2, o, bits, size, w, j):  # noqa: ANN001, ANN202
    """w[j] = the fp32 weights of row `o` of 5- or 6-bit codes (or 4-bit ones whose groups straddle the
    half-row): a bit plane of columns at a time, its nibbles and high bits together, then scaled by group.

    The loops index the row with unsigned offsets: a signed index makes numba test it for a negative
    value (Python's wrap-around) at every element, which kept such loops scalar; slices (unpack_row's
    way) avoid the test but cost a reference count each, 27 a row. bench/packed_bits.py, 1152 x 896 at one
    token (Qwen2.5-Coder's qkv), fastest call against one-byte codes: 5 bits 2.23x -> 2.03x, 6 bits 2.56x
    -> 2.47x. What is left is the work itself: the high bits' shifts and the second (scaling) pass.)"""
    columns = w.shape[1]
    half = np.uint64(columns // 2)
    width = bits - 4
    planes = 8 // width if width else 2
    span = np.uint64(columns // planes)
    mask = np.int32((1 << width) - 1)
    row, out = codes2[o], w[j]
    for q in range(planes):
        start = np.uint64(q % (planes // 2)) * span  # planes in the low nibbles first, then the high ones
        base = np.uint64(q) * span
        nibble_shift = np.int32(4 * (q // (planes // 2)))
        if width:
            high_shift = np.int32(width * q)
            for i in range(span):
                nibble = (np.int32(row[start + i]) >> nibble_shift) & np.int32(15)
                high = (np.int32(row[half + i]) >> high_shift) & mask
                out[base + i] = np.float32(nibble | (high << np.int32(4)))
        else:
            for i in range(span):
                out[base + i] = np.float32((np.int32(row[start + i]) >> nibble_shift) & np.int32(15))
    step = np.uint64(size)
    for g in range(columns // size):
        s, m = half_to_float(scales2[o, g]), half_to_float(biases2[o, g])
        first = np.uint64(g) * step
        for k in range(step):
            out[first + k] = out[first + k] * s + m
