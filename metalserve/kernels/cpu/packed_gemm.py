"""`x @ w.T` for many rows of `x` (a prefill chunk), `w` in its packed codes: dequantize a tile, then GEMM.

The packed-codes kernel (packed_linear.py) unpacks four output rows and streams every input row past
them: right for decode steps, where reading the weights is the cost, but at hundreds of rows the matmul
is the cost and its register tile reached a fraction of MKL's GEMM. Here each work item unpacks a tile of
output rows (sized to stay in L2) into fp32 once and multiplies the whole chunk against it with MKL's
sgemm (gemm.py) on its own thread, straight into its columns of the output. The unpacking is paid once
per tile per chunk, as the fp32 copy this path does without would have been read once. With
`--cpu-bf16-prefill` (gemm.py) the chunk and each tile are rounded to bfloat16 and multiplied by MKL's
bfloat16 GEMM (AMX tiles where the CPU has them); the codes go to bfloat16 64 columns a step (bf16_rows.py)
where their layout allows, else through unpack_row's fp32 row.
"""

from __future__ import annotations

import numba
import numpy as np

from metalserve.kernels.cpu import bf16_rows, int8_windows
from metalserve.kernels.cpu.gemm import F32, gemm_bf16_packed, pack_bf16, sgemm, to_bf16
from metalserve.kernels.cpu.packed_unpack import unpack_row

# Rows at and above which a step's projections take this kernel (where a GEMM beats the register tile).
GEMM_MIN_ROWS = 64
TILE_FLOATS = 1 << 18  # a tile's fp32 weights: 1 MiB, within one core's L2 beside MKL's packed panels


@numba.njit(fastmath=True, cache=True, nogil=True)
def _tiles(seg, layer):  # noqa: ANN001, ANN202  (numba infers the types)
    """Each tile's segment and first output row within it, for layer `layer` of `seg`."""
    per_tile = max(16, min(256, (TILE_FLOATS // seg.columns) // 16 * 16))
    first, last = seg.layer_first[layer], seg.layer_first[layer + 1]
    count = 0
    for s in range(first, last):
        count += (seg.rows[s] + per_tile - 1) // per_tile
    tile_seg = np.empty(count, np.int64)
    tile_row = np.empty(count, np.int64)
    i = 0
    for s in range(first, last):
        for start in range(0, seg.rows[s], per_tile):
            tile_seg[i], tile_row[i] = s, start
            i += 1
    return tile_seg, tile_row, per_tile


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _rows_to_bf16(x, out):  # noqa: ANN001, ANN202
    """gemm.to_bf16 of a chunk's rows, the threads sharing them."""
    for r in numba.prange(x.shape[0]):
        to_bf16(x[r], out[r])


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True, boundscheck=False)
def segments_gemm_kernel(x, seg, layer, gemm, out):  # noqa: ANN001, ANN202
    """`out[:, :] = x @ w.T + bias` for layer `layer` of `seg` (packed_linear.Segments); `x` and `out`
    C-contiguous; `gemm` usable (gemm.host_gemm)."""
    rows, columns, width = x.shape[0], seg.columns, out.shape[1]
    tile_seg, tile_row, per_tile = _tiles(seg, layer)
    x16 = np.empty((rows if gemm.bf16 else 0, columns), np.uint16)
    packed = np.empty(0, np.uint8)
    if gemm.bf16:  # the chunk rounded and packed for MKL once, not once per tile
        _rows_to_bf16(x, x16)
        packed = pack_bf16(gemm, rows, per_tile, columns, x16.ctypes.data, columns)
    bias = seg.bias[layer]
    has_bias = False  # most projections have none: their zeros are not added to every row
    for o in range(width):
        has_bias = has_bias or bias[o] != 0
    for i in numba.prange(tile_seg.shape[0]):
        s, start = tile_seg[i], tile_row[i]
        outputs = seg.rows[s]
        n = min(per_tile, outputs - start)
        groups = seg.scales[s].shape[0] // outputs
        at = seg.out_at[s] + start
        target = out.ctypes.data + at * F32  # this tile's columns of every output row
        if gemm.bf16:
            w16 = np.empty((n, columns), np.uint16)
            bits, data, scales, biases = seg.bits[s], seg.data[s], seg.scales[s], seg.biases[s]
            if bf16_rows.rows_apply(bits, columns, columns // groups):  # straight to bfloat16, 64 columns a step
                params = int8_windows.window_params(bits, columns)
                bf16_rows.rows_to_bf16(data, scales, biases, start, n, bits, columns, groups, params, w16)
            else:  # each row unpacked into a one-row scratch and rounded while it is in L1
                row = np.empty((1, columns), np.float32)
                for j in range(n):
                    unpack_row(data, scales, biases, start + j, bits, columns, groups, row, 0)
                    to_bf16(row[0], w16[j])
            gemm_bf16_packed(gemm, rows, n, columns, packed.ctypes.data, w16.ctypes.data, columns, target, width)
        else:
            w = np.empty((n, columns), np.float32)
            for j in range(n):
                unpack_row(seg.data[s], seg.scales[s], seg.biases[s], start + j, seg.bits[s], columns, groups, w, j)
            sgemm(gemm, True, rows, n, columns, x.ctypes.data, columns, w.ctypes.data, columns, target, width)
        if has_bias:  # by the tile's own thread, while its columns are in the cache
            for t in range(rows):
                for o in range(at, at + n):
                    out[t, o] += bias[o]
    # The pack read through its address stays alive to here (numba frees an array after its last use).
    return packed.shape[0]
