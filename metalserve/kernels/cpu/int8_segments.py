"""Which of a decode step's segments packed_linear dots in integers (`--cpu-int8-activations`), and how.

A step's input is quantized once (`quantized_input`), only where some segment will read it; each segment
then takes one of the three integer kernels (`int8_segment`) or, returning False, the float tile:
- fewer than 4 rows: int8_dot.int8_rows (4 bits whose half-rows hold whole groups of 32, 8 bits in groups
  of 32) or int8_dot.int8_plane_rows (4, 5 and 6 bits read a window at a time);
- 4 to 8 rows: int8_windows.int8_window_rows for 4-, 5-, 6- and 8-bit codes.
"""

from __future__ import annotations

import numba
import numpy as np

from metalserve.kernels.cpu import int8_dot, int8_windows


@numba.njit(fastmath=True, cache=True, nogil=True, boundscheck=False)
def quantized_input(x, seg, first, last):  # noqa: ANN001, ANN202  (numba infers the types)
    """`x` quantized for segments `first` to `last` of `seg`, where one of them will read it: (whether it
    was, codes, block scales, block sums, half-block sums, lane scales, window params for 4, 5, 6
    and 8 bits)."""
    rows, columns = x.shape
    int8 = seg.int8 and columns % 64 == 0 and rows < int8_windows.MIN_ROWS
    if seg.int8 and columns % 64 == 0 and int8_windows.MIN_ROWS <= rows <= int8_windows.MAX_ROWS:
        for s in range(first, last):  # quantized only where a segment will read it
            size = columns * seg.rows[s] // seg.scales[s].shape[0]
            int8 = int8 or int8_windows.windows_apply(seg.bits[s], columns, size)
    blocks = columns // 32 if int8 else 1
    xq = np.empty((rows, blocks * 32), np.int8)
    xscale, xtotal = np.empty((rows, blocks), np.float32), np.empty((rows, blocks), np.float32)
    xtotal16 = np.empty((rows, 2 * blocks), np.float32)
    if int8:
        for r in range(rows):
            int8_dot.quantize_row(x, r, xq[r], xscale[r], xtotal[r], xtotal16[r])
    windows = int8 and rows >= int8_windows.MIN_ROWS
    lane_scales = int8_windows.lane_scales(xscale) if windows else xscale
    no_params = np.zeros((0, 9), np.int64)
    params4, params5, params6, params8 = no_params, no_params, no_params, no_params
    if windows:
        params4, params5 = int8_windows.window_params(4, columns), int8_windows.window_params(5, columns)
        params6, params8 = int8_windows.window_params(6, columns), int8_windows.window_params(8, columns)
    return int8, xq, xscale, xtotal, xtotal16, lane_scales, params4, params5, params6, params8


@numba.njit(fastmath=True, cache=True, nogil=True, boundscheck=False)
def int8_segment(q, codes2, scales2, biases2, bits, o_lo, o_hi, out, at):  # noqa: ANN001, ANN202
    """`out[:, at + o]` for outputs o_lo <= o < o_hi of one segment through an integer kernel, from
    quantized_input's `q`; False (nothing written) where the segment takes the float tile."""
    int8, xq, xscale, xtotal, xtotal16, lane_scales, params4, params5, params6, params8 = q
    if not int8:
        return False
    rows, columns = xq.shape
    groups = scales2.shape[1]
    size = columns // groups
    if rows >= int8_windows.MIN_ROWS:
        if not int8_windows.windows_apply(bits, columns, size):
            return False
        kind = params4 if bits == 4 else params5 if bits == 5 else params6 if bits == 6 else params8
        # One pass of 8 or 4 rows; 5 to 7 rows as two overlapping passes of 4 (the rows both hold get the
        # same sums twice).
        count = 8 if rows == 8 else 4
        for r0 in range(0, rows - count + 1, max(1, rows - count)):
            int8_windows.int8_window_rows(
                xq, lane_scales, xtotal, xtotal16, codes2, scales2, biases2, bits, kind, r0, count, o_lo, o_hi, out, at
            )
        return True
    if groups == columns // 32 and (bits == 8 or bits == 4):  # 4 bits: half-rows of whole groups
        for r in range(rows):
            int8_dot.int8_rows(xq[r], xscale[r], xtotal[r], codes2, scales2, biases2, bits, o_lo, o_hi, out, r, at)
        return True
    if int8_dot.plane_rows_apply(bits, columns, size):
        for r in range(rows):
            int8_dot.int8_plane_rows(
                xq[r], xscale[r], xtotal[r], xtotal16[r], codes2, scales2, biases2, bits, o_lo, o_hi, out, r, at
            )
        return True
    return False
