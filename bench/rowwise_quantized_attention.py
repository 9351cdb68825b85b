"""The CPU kernel over quantized pages before it dequantized a tile of rows' pages once: every query row
and KV head dequantized all the keys and values it reads into its own buffers, and each float16 scale
through a power of two. Kept here only as the baseline that bench/cpu_attention.py times the current
kernel against (same formats, same answer).
"""

from __future__ import annotations

# isort: off
import metalserve  # noqa: F401  (before numba: it points numba's cache at this version's folder)

# isort: on
import numba
import numpy as np

from metalserve.kernels.cpu.attention import _scores, _softmax_rows, _weighted_values
from metalserve.kernels.cpu.numba_lock import launch_lock
from metalserve.kernels.cpu.quantized_attention import _page_slots


@numba.njit(fastmath=True, cache=True, nogil=True)
def _half(bits):  # noqa: ANN001, ANN202
    b = np.int32(bits)
    exponent, mantissa = (b >> 10) & 0x1F, b & 0x3FF
    if exponent == 0:
        value = np.float32(mantissa) * np.float32(2.0**-24)
    elif exponent == 31:
        value = np.float32(np.inf)
    else:
        value = np.float32(1024 + mantissa) * np.float32(2.0) ** np.float32(exponent - 25)
    return -value if b & 0x8000 else value


@numba.njit(fastmath=True, cache=True, nogil=True)
def _dequantize_slots(codes, scales, biases, q4, slots, out):  # noqa: ANN001, ANN202
    dim = out.shape[1]
    if q4:
        group = dim // scales.shape[1]
        for j in range(slots.shape[0]):
            s = slots[j]
            for g in range(scales.shape[1]):
                scale, bias = _half(scales[s, g]), _half(biases[s, g])
                for c in range(g * group, (g + 1) * group, 2):
                    byte = np.int32(codes[s, c // 2])
                    out[j, c] = np.float32(byte & 0xF) * scale + bias
                    out[j, c + 1] = np.float32(byte >> 4) * scale + bias
    else:
        for j in range(slots.shape[0]):
            s = slots[j]
            scale = _half(scales[s, 0])
            for c in range(dim):
                out[j, c] = np.float32(codes[s, c]) * scale


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _rowwise_kernel(  # numba infers the types
    q, codes, scales, biases, q4, block_tables, row_req, row_pos, block_size, scale, window, softcap, sinks, out
):
    num_q_heads, num_kv_heads, dim = q.shape[1], codes.shape[1], q.shape[2]
    group = num_q_heads // num_kv_heads
    items = q.shape[0] * num_kv_heads
    for k in numba.prange(items):
        idx = k // 2 if k % 2 == 0 else items - 1 - k // 2
        row, h = idx // num_kv_heads, idx % num_kv_heads
        r, last = row_req[row], row_pos[row]
        first = max(0, last + 1 - window) if window > 0 else 0
        n = last + 1 - first
        slots = _page_slots(block_tables[r], first, n, block_size)
        keys = np.empty((n, dim), np.float32)
        values = np.empty((n, dim), np.float32)
        _dequantize_slots(codes[0, h], scales[0, h], biases[0, h], q4, slots, keys)
        _dequantize_slots(codes[1, h], scales[1, h], biases[1, h], q4, slots, values)
        local = np.arange(n)
        scores = np.empty((group, n), np.float32)
        pow2 = np.empty(n, np.int32)
        tops = np.empty(group, np.float32)
        _scores(q[row], keys, local, h * group, scores)
        _softmax_rows(scores, n, scale, softcap, sinks, False, h * group, pow2, tops)
        _weighted_values(scores, values, local, out[row, h * group : (h + 1) * group])


def rowwise_attend_quantized_rows(
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
) -> np.ndarray:
    """The old `attend_quantized_rows` (no window, softcap or sinks: the bench uses none)."""
    half = scales.view(np.uint16)
    out = np.empty(q.shape, np.float32)
    with launch_lock:
        _rowwise_kernel(
            q,
            codes,
            half,
            biases.view(np.uint16) if biases is not None else half,
            codes.dtype == np.uint8,
            block_tables,
            row_req,
            row_pos,
            block_size,
            np.float32(scale),
            0,
            np.float32(0.0),
            np.zeros(q.shape[1], np.float32),
            out,
        )
    return out
