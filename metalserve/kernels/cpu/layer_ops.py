"""The small per-token operations of a llama-family layer, compiled with numba for the host forward.

On MLX's CPU backend each MLX op costs some 20-90 us of dispatch however small its input; a decode step
of the default model ran about ten of them per layer (norms, residual adds, RoPE, reshapes): a third of
the step at batch 1. These loops take microseconds.
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(fastmath=True, cache=True, nogil=True)
def _rms_norm_kernel(x, weight, eps, out):  # noqa: ANN001, ANN202  (numba infers the types)
    rows, width = x.shape
    for r in range(rows):
        total = np.float32(0.0)
        for c in range(width):
            total += x[r, c] * x[r, c]
        inv = np.float32(1.0) / np.sqrt(total / np.float32(width) + eps)
        for c in range(width):
            out[r, c] = x[r, c] * inv * weight[c]


@numba.njit(fastmath=True, cache=True, nogil=True)
def _rope_kernel(x, positions, inv_freq, scale, mscale):  # noqa: ANN001, ANN202
    """`mscale`: a factor on the rotated features before rotating (phi3's SuScaledRoPE), 1 for plain RoPE."""
    tokens, heads, _ = x.shape
    half = inv_freq.shape[0]
    if mscale != 1:
        for t in range(tokens):
            for h in range(heads):
                for i in range(2 * half):
                    x[t, h, i] *= mscale
    for t in range(tokens):
        for i in range(half):
            angle = np.float32(positions[t]) * scale * inv_freq[i]  # float32 throughout, as MLX computes it
            cos = np.cos(angle)
            sin = np.sin(angle)
            for h in range(heads):
                a = x[t, h, i]
                b = x[t, h, i + half]
                x[t, h, i] = a * cos - b * sin
                x[t, h, i + half] = a * sin + b * cos


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """`x * rsqrt(mean(x^2) + eps) * weight` over the last axis of `[..., width]` float32."""
    flat = np.ascontiguousarray(x, np.float32).reshape(-1, x.shape[-1])
    out = np.empty_like(flat)
    _rms_norm_kernel(flat, np.ascontiguousarray(weight, np.float32), np.float32(eps), out)
    return out.reshape(x.shape)


def rope_inverse_frequencies(dims: int, base: float) -> np.ndarray:
    """`base^(-2i/dims)` for the `dims // 2` rotated pairs, in float32 the way MLX computes them."""
    half = dims // 2
    return np.exp(-np.arange(half, dtype=np.float32) * np.float32(np.log(base) / half))


def rope_in_place(
    x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, scale: float = 1.0, mscale: float = 1.0
) -> None:
    """Rotate `x` `[T, H, D]` float32 as MLX's non-traditional RoPE does (pairs `i` and `i + dims/2`, the
    first `dims = 2 * len(inv_freq)` features, first multiplied by `mscale`), token `t` at position
    `positions[t] * scale`."""
    if x.dtype != np.float32 or not x.flags.c_contiguous or x.ndim != 3 or 2 * len(inv_freq) > x.shape[2]:
        raise ValueError(f"rope_in_place takes contiguous [T, H, D] float32, got {x.shape} {x.dtype}")
    _rope_kernel(x, np.ascontiguousarray(positions, np.int64), inv_freq, np.float32(scale), np.float32(mscale))
