"""`x @ w.T` for a few rows of `x`, reading `w` as its stored one-byte codes, compiled with numba.

Decoding a batch of a few tokens on the CPU is bound by reading the weights: fp32 weights cost four bytes
each, the codes one. Every four output rows are dequantized once into a scratch tile in L1 and then dotted
with every input row, sharing each load of the input, so the decode cost is paid once per step, not once
per token. Prefill-sized batches are compute-bound and stay with MKL on the fp32 weights.
"""

from __future__ import annotations

import numba
import numpy as np

from metalserve.kernels.affine_codes import AffineCodes
from metalserve.kernels.numba_lock import launch_lock


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True, boundscheck=False)
def _affine_linear_kernel(x, codes, scales, biases, chunks, out):  # noqa: ANN001, ANN202  (numba infers the types)
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
                o = min(4 * quad + j, outputs - 1)  # past the end: repeat the last row, not stored below
                for g in range(groups):
                    base = g * group_size
                    s = scales[o, g]
                    m = biases[o, g]
                    for k in range(group_size):
                        w[j, base + k] = s * np.float32(codes[o, base + k]) + m
            first = 4 * quad
            for r in range(rows):
                a0 = np.float32(0.0)
                a1 = np.float32(0.0)
                a2 = np.float32(0.0)
                a3 = np.float32(0.0)
                for k in range(width):
                    xv = x[r, k]
                    a0 += w[0, k] * xv
                    a1 += w[1, k] * xv
                    a2 += w[2, k] * xv
                    a3 += w[3, k] * xv
                out[r, first] = a0
                if first + 1 < outputs:
                    out[r, first + 1] = a1
                if first + 2 < outputs:
                    out[r, first + 2] = a2
                if first + 3 < outputs:
                    out[r, first + 3] = a3


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
