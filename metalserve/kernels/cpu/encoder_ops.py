"""The non-matmul work of a BERT layer on the host, compiled with numba: GELU, layer norm, and the
bidirectional attention of each packed prompt.

MLX's CPU backend computes `erf` and `exp` one element at a time through libm: GELU on a 2048 x 1536 tile
took 75-120 ms there against 12 ms for the matmul before it, and libm's `erf` under numba still took 24
ms. GELU here evaluates erf with Eigen's float rational polynomial (the one PyTorch's CPU kernels
vectorise; within 4e-7 of float64 erf over the float range), which the compiler turns into SIMD: 3-9 ms.
"""

from __future__ import annotations

import numba
import numpy as np

from metalserve.kernels.cpu.fast_exp import exp_parts

# Eigen's `generic_fast_erf_float` coefficients: erf(x) = x * P(x^2) / Q(x^2) on [-4, 4], +-1 outside.
_A1, _A3, _A5, _A7 = -2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05
_A9, _A11, _A13 = -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02
_B0, _B2, _B4, _B6, _B8 = (
    -1.42647390514189e-02,
    -7.37332916720468e-03,
    -1.68282697438203e-03,
    -2.13374055278905e-04,
    -1.45660718464996e-05,
)


@numba.njit(fastmath=True, cache=True, nogil=True)
def _gelu_kernel(x):  # noqa: ANN001, ANN202  (numba infers the types)
    """x = x * (1 + erf(x / sqrt 2)) / 2 in place, over a flat float32 array."""
    for i in range(x.shape[0]):
        v = x[i]
        z = v * np.float32(0.7071067811865476)
        z = np.float32(4.0) if z > np.float32(4.0) else z
        z = np.float32(-4.0) if z < np.float32(-4.0) else z
        z2 = z * z
        p = z2 * np.float32(_A1) + np.float32(_A3)
        p = z2 * p + np.float32(_A5)
        p = z2 * p + np.float32(_A7)
        p = z2 * p + np.float32(_A9)
        p = z2 * p + np.float32(_A11)
        p = z2 * p + np.float32(_A13)
        q = z2 * np.float32(_B8) + np.float32(_B6)
        q = z2 * q + np.float32(_B4)
        q = z2 * q + np.float32(_B2)
        q = z2 * q + np.float32(_B0)
        x[i] = np.float32(0.5) * v * (np.float32(1.0) + z * p / q)


@numba.njit(fastmath=True, cache=True, nogil=True)
def _add_layer_norm_kernel(x, residual, weight, bias, eps):  # noqa: ANN001, ANN202
    """x = LayerNorm(x + residual) in place, row by row (two passes: mean, then variance)."""
    rows, width = x.shape
    for r in range(rows):
        total = np.float32(0.0)
        for c in range(width):
            x[r, c] += residual[r, c]
            total += x[r, c]
        mean = total / np.float32(width)
        var = np.float32(0.0)
        for c in range(width):
            d = x[r, c] - mean
            var += d * d
        inv = np.float32(1.0) / np.sqrt(var / np.float32(width) + eps)
        for c in range(width):
            x[r, c] = (x[r, c] - mean) * inv * weight[c] + bias[c]


def gelu_in_place(x: np.ndarray) -> None:
    """The exact (erf) GELU of a contiguous float32 array, in place."""
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        raise ValueError(f"gelu_in_place takes contiguous float32, got {x.dtype}")
    _gelu_kernel(x.reshape(-1))


def add_layer_norm_in_place(
    x: np.ndarray, residual: np.ndarray | None, weight: np.ndarray, bias: np.ndarray, eps: float
) -> None:
    """x = LayerNorm(x + residual) over the last axis of contiguous float32 `[rows, width]` arrays."""
    if x.dtype != np.float32 or not x.flags.c_contiguous or x.ndim != 2:
        raise ValueError(f"add_layer_norm_in_place takes contiguous [rows, width] float32, got {x.shape} {x.dtype}")
    zero = residual is None
    _add_layer_norm_kernel(x, np.zeros_like(x) if zero else residual, weight, bias, np.float32(eps))


@numba.njit(fastmath=True, cache=True, nogil=True, inline="always")
def _exp_row(row, pow2, n):  # noqa: ANN001, ANN202
    """row[:n] = exp(row - max(row)) (a polynomial the compiler vectorises; libm's exp is one call a value);
    returns 1 / the sum."""
    top = row[0]
    for j in range(1, n):
        top = max(top, row[j])
    for j in range(n):
        row[j], pow2[j] = exp_parts(row[j] - top)
    powers = pow2[:n].view(np.float32)
    total = np.float32(0.0)
    for j in range(n):
        row[j] *= powers[j]
        total += row[j]
    return np.float32(1.0) / total


@numba.njit(fastmath=True, cache=True, nogil=True)
def _bidirectional_attention_kernel(qkv, cu, heads, scale, out):  # noqa: ANN001, ANN202
    """out[t, h*D:(h+1)*D] = softmax(q_t . K^T * scale) V over the prompt that holds t, for each head h;
    `qkv` is `[T, 3 * hidden]` (q, k, v side by side), `cu` the prompts' starts and ends. A head's K^T and V
    are copied out once (the score loop runs along keys); four query rows share each key load."""
    hidden = out.shape[1]
    dim = hidden // heads
    longest = 0
    for s in range(cu.shape[0] - 1):
        longest = max(longest, cu[s + 1] - cu[s])
    keys = np.empty((dim, longest), dtype=np.float32)
    vals = np.empty((longest, dim), dtype=np.float32)
    rows = np.empty((4, longest), dtype=np.float32)
    pow2 = np.empty(longest, dtype=np.int32)
    acc = np.empty(dim, dtype=np.float32)
    for s in range(cu.shape[0] - 1):
        a, n = cu[s], cu[s + 1] - cu[s]
        for h in range(heads):
            qo, ko, vo = h * dim, hidden + h * dim, 2 * hidden + h * dim
            for j in range(n):
                for c in range(dim):
                    keys[c, j] = qkv[a + j, ko + c]
                    vals[j, c] = qkv[a + j, vo + c]
            for i0 in range(0, n, 4):
                m = min(4, n - i0)
                for g in range(m):
                    for j in range(n):
                        rows[g, j] = np.float32(0.0)
                for c in range(dim):
                    if m == 4:
                        q0 = qkv[a + i0, qo + c] * scale
                        q1 = qkv[a + i0 + 1, qo + c] * scale
                        q2 = qkv[a + i0 + 2, qo + c] * scale
                        q3 = qkv[a + i0 + 3, qo + c] * scale
                        for j in range(n):
                            kv = keys[c, j]
                            rows[0, j] += q0 * kv
                            rows[1, j] += q1 * kv
                            rows[2, j] += q2 * kv
                            rows[3, j] += q3 * kv
                    else:
                        for g in range(m):
                            qc = qkv[a + i0 + g, qo + c] * scale
                            for j in range(n):
                                rows[g, j] += qc * keys[c, j]
                for g in range(m):
                    row = rows[g]
                    inv = _exp_row(row, pow2, n)
                    for c in range(dim):
                        acc[c] = np.float32(0.0)
                    for j in range(n):
                        w = row[j]
                        for c in range(dim):
                            acc[c] += w * vals[j, c]
                    for c in range(dim):
                        out[a + i0 + g, qo + c] = acc[c] * inv


def bidirectional_attention(qkv: np.ndarray, cu_seqlens: np.ndarray, heads: int) -> np.ndarray:
    """Each prompt's tokens attend to all of that prompt's tokens (an encoder's attention), every head;
    `qkv` `[T, 3 * hidden]` float32 (q, k, v side by side), `cu_seqlens` `[prompts + 1]`. One thread:
    NumPy's batched matmul here made one OpenBLAS call per head, each paying the BLAS threads' hand-off,
    milliseconds on a loaded machine."""
    if qkv.dtype != np.float32 or not qkv.flags.c_contiguous or qkv.ndim != 2 or qkv.shape[1] % 3:
        raise ValueError(f"bidirectional_attention takes contiguous [T, 3 * hidden] float32, got {qkv.shape}")
    out = np.empty((qkv.shape[0], qkv.shape[1] // 3), dtype=np.float32)
    _bidirectional_attention_kernel(
        qkv, np.ascontiguousarray(cu_seqlens, np.int64), heads, np.float32(1.0 / np.sqrt(out.shape[1] // heads)), out
    )
    return out
