"""`x @ w.T` for a few rows of `x`, reading `w` as its stored one-byte codes, compiled with numba.

Decoding a batch of a few tokens on the CPU is bound by reading the weights: fp32 weights cost four bytes
each, the codes one. Every four output rows are dequantized once into a scratch tile in L1 and then dotted
with the input rows four at a time: sixteen accumulators share each load of the tile and of the input.
Against one row at a time, that took the default model's 120 projections from 36 to 28 ms at 8 rows and
from 73 to 54 ms at 16 (a verify window of speculative tokens is such a step). Prefill-sized batches
stay with MKL on the fp32 weights.
"""

from __future__ import annotations

import numba
import numpy as np

from metalserve.kernels.cpu.affine_codes import AffineCodes
from metalserve.kernels.cpu.numba_lock import launch_lock


@numba.njit(fastmath=True, cache=True, nogil=True, boundscheck=False)
def _store(out, r, first, outputs, a0, a1, a2, a3):  # noqa: ANN001, ANN202  (numba infers the types)
    """One input row's four outputs, the ones past the last output row dropped."""
    out[r, first] = a0
    if first + 1 < outputs:
        out[r, first + 1] = a1
    if first + 2 < outputs:
        out[r, first + 2] = a2
    if first + 3 < outputs:
        out[r, first + 3] = a3


@numba.njit(fastmath=True, cache=True, nogil=True, boundscheck=False)
def _four_rows(x, r, w, out, first, outputs):  # noqa: ANN001, ANN202
    """Rows r..r+3 of `x` against the four dequantized output rows in `w`."""
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = np.float32(0.0)
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = np.float32(0.0)
    for k in range(x.shape[1]):
        w0 = w[0, k]
        w1 = w[1, k]
        w2 = w[2, k]
        w3 = w[3, k]
        x0 = x[r, k]
        x1 = x[r + 1, k]
        x2 = x[r + 2, k]
        x3 = x[r + 3, k]
        a00 += w0 * x0
        a01 += w1 * x0
        a02 += w2 * x0
        a03 += w3 * x0
        a10 += w0 * x1
        a11 += w1 * x1
        a12 += w2 * x1
        a13 += w3 * x1
        a20 += w0 * x2
        a21 += w1 * x2
        a22 += w2 * x2
        a23 += w3 * x2
        a30 += w0 * x3
        a31 += w1 * x3
        a32 += w2 * x3
        a33 += w3 * x3
    _store(out, r, first, outputs, a00, a01, a02, a03)
    _store(out, r + 1, first, outputs, a10, a11, a12, a13)
    _store(out, r + 2, first, outputs, a20, a21, a22, a23)
    _store(out, r + 3, first, outputs, a30, a31, a32, a33)


@numba.njit(fastmath=True, cache=True, nogil=True, boundscheck=False)
def _two_rows(x, r, w, out, first, outputs):  # noqa: ANN001, ANN202
    """Rows r and r+1 of `x` against the four dequantized output rows in `w`."""
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = np.float32(0.0)
    for k in range(x.shape[1]):
        w0, w1, w2, w3 = w[0, k], w[1, k], w[2, k], w[3, k]
        x0, x1 = x[r, k], x[r + 1, k]
        a00 += w0 * x0
        a01 += w1 * x0
        a02 += w2 * x0
        a03 += w3 * x0
        a10 += w0 * x1
        a11 += w1 * x1
        a12 += w2 * x1
        a13 += w3 * x1
    _store(out, r, first, outputs, a00, a01, a02, a03)
    _store(out, r + 1, first, outputs, a10, a11, a12, a13)


@numba.njit(fastmath=True, cache=True, nogil=True, boundscheck=False)
def _one_row(x, r, w, out, first, outputs):  # noqa: ANN001, ANN202
    """Row r of `x` against the four dequantized output rows in `w`."""
    a0 = a1 = a2 = a3 = np.float32(0.0)
    for k in range(x.shape[1]):
        xv = x[r, k]
        a0 += w[0, k] * xv
        a1 += w[1, k] * xv
        a2 += w[2, k] * xv
        a3 += w[3, k] * xv
    _store(out, r, first, outputs, a0, a1, a2, a3)


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True, boundscheck=False)
def _affine_linear_kernel(x, codes, scales, biases, chunks, out):  # noqa: ANN001, ANN202
    rows, width = x.shape
    outputs = codes.shape[0]
    groups = scales.shape[1]
    group_size = width // groups
    quads = (outputs + 3) // 4  # four output rows share every load of x
    per_chunk = (quads + chunks - 1) // chunks
    for c in numba.prange(chunks):
        w = np.empty((4, width), np.float32)
        for quad in range(c * per_chunk, min(quads, (c + 1) * per_chunk)):
            for j in range(4):
                o = min(4 * quad + j, outputs - 1)  # past the end: repeat the last row, not stored
                for g in range(groups):
                    base = g * group_size
                    s = scales[o, g]
                    m = biases[o, g]
                    for k in range(group_size):
                        w[j, base + k] = s * np.float32(codes[o, base + k]) + m
            first = 4 * quad
            r = 0
            while r + 4 <= rows:
                _four_rows(x, r, w, out, first, outputs)
                r += 4
            if r + 2 <= rows:
                _two_rows(x, r, w, out, first, outputs)
                r += 2
            if r < rows:
                _one_row(x, r, w, out, first, outputs)


def affine_linear(x: np.ndarray, weight: AffineCodes) -> np.ndarray:
    """`x` `[T, in]` float32 -> `x @ weight.dense().T` `[T, out]` float32."""
    if x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != weight.codes.shape[1]:
        raise ValueError(f"affine_linear takes [T, {weight.codes.shape[1]}] float32, got {x.shape} {x.dtype}")
    out = np.empty((x.shape[0], weight.codes.shape[0]), np.float32)
    with launch_lock:
        # Several chunks per thread even out a core that is busy with something else.
        chunks = numba.get_num_threads() * 8
        _affine_linear_kernel(np.ascontiguousarray(x), weight.codes, weight.scales, weight.biases, chunks, out)
    return out
