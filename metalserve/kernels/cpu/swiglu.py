"""SwiGLU (`silu(gate) * up`) and GeGLU (`gelu_tanh(gate) * up`, gemma3) compiled with numba, for MLX's
CPU backend.

There MLX computes exp one element at a time (about 16 ns each on this machine), which made the MLP's
activation cost as much as one of its matmuls at batch 32. numba's `np.exp` is a libm call per element
too, so SwiGLU takes its sigmoid from fast_exp's polynomial (vector loops), and a prefill chunk's rows
are split over the threads: a 512-row chunk of the coder 0.5B's MLP (4864 wide) took 6.4 ms a layer
before, on one thread.
"""

from __future__ import annotations

import numba
import numpy as np

from metalserve.kernels.cpu.fast_exp import exp_parts

PARALLEL_MIN_ROWS = 64  # rows at and above which the threads share them (a parallel launch costs microseconds)


@numba.njit(fastmath=True, cache=True, nogil=True)
def _swiglu_row(gate_up, out, r, parts, pow2):  # noqa: ANN001, ANN202
    """out[r] = silu(gate) * up for row r, sigmoid(g) from e = exp(-|g|): 1 / (1 + e) or e / (1 + e)."""
    width = out.shape[1]
    for c in range(width):
        parts[c], pow2[c] = exp_parts(-abs(gate_up[r, c]))
    scale = pow2.view(np.float32)
    for c in range(width):
        g = gate_up[r, c]
        e = parts[c] * scale[c]
        sigmoid = (np.float32(1.0) if g >= 0 else e) / (np.float32(1.0) + e)
        out[r, c] = g * sigmoid * gate_up[r, width + c]


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _swiglu_parallel(gate_up, out):  # noqa: ANN001, ANN202
    for r in numba.prange(out.shape[0]):
        parts = np.empty(out.shape[1], np.float32)
        pow2 = np.empty(out.shape[1], np.int32)
        _swiglu_row(gate_up, out, r, parts, pow2)


@numba.njit(fastmath=True, cache=True, nogil=True)
def _swiglu_kernel(gate_up, out):  # noqa: ANN001, ANN202  (numba infers the types)
    rows, width = out.shape
    if rows >= PARALLEL_MIN_ROWS:
        _swiglu_parallel(gate_up, out)
        return
    parts = np.empty(width, np.float32)
    pow2 = np.empty(width, np.int32)
    for r in range(rows):
        _swiglu_row(gate_up, out, r, parts, pow2)


@numba.njit(fastmath=True, cache=True, nogil=True)
def _gelu_tanh_glu_kernel(gate_up, out):  # noqa: ANN001, ANN202
    """mlx.nn.gelu_approx(gate) * up: 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))."""
    rows, width = out.shape
    k = np.float32(np.sqrt(2.0 / np.pi))
    for r in range(rows):
        for c in range(width):
            g = gate_up[r, c]
            inner = k * (g + np.float32(0.044715) * g * g * g)
            out[r, c] = np.float32(0.5) * g * (np.float32(1.0) + np.tanh(inner)) * gate_up[r, width + c]


def gated(gate_up: np.ndarray, activation: str) -> np.ndarray:
    """`[T, 2I]` float32 (gate columns, then up columns) -> `act(gate) * up` `[T, I]`; `activation`
    "silu" or "gelu_tanh"."""
    if activation == "silu":
        return swiglu(gate_up)
    if activation != "gelu_tanh":
        raise ValueError(f"no gated activation {activation!r}")
    out = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), np.float32)
    _gelu_tanh_glu_kernel(np.ascontiguousarray(gate_up, np.float32), out)
    return out


def swiglu(gate_up: np.ndarray) -> np.ndarray:
    """`[T, 2I]` float32 (gate columns, then up columns) -> `silu(gate) * up` `[T, I]`."""
    if gate_up.dtype != np.float32 or gate_up.ndim != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"swiglu takes [T, 2I] float32, got {gate_up.shape} {gate_up.dtype}")
    out = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), np.float32)
    _swiglu_kernel(gate_up, out)
    return out
