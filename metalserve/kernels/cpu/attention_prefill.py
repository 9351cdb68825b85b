"""Causal attention for a prefill chunk on the CPU: blocks of query rows against the context with GEMMs.

The paged kernel (attention.py) takes one query row at a time: right for decode, but a chunk of 512 rows
at a 16k-token context reads every key 512 times per head and does its dot products one key at a time
(at 16k tokens attention was about a quarter of a chunk's time). Here a run of consecutive rows of one
request (a prefill chunk) is attended in blocks: the request's keys and values are gathered from their
pages once per chunk, then for each KV head and block of query rows the scores are one sgemm
(`[rows x group, D] @ K.T`), masked causally (and to a sliding window), soft-capped and softmaxed in place,
and the output a second sgemm (`P @ V`). Mathematically the paged kernel's result; the sums run in
another order (within float32 rounding).

Rows that are not part of a long run (decode rows, short chunks) and layers with attention sinks still
take the paged kernel; `attention.attend` splits a step between the two.
"""

from __future__ import annotations

import numba
import numpy as np

from metalserve.kernels.cpu.fast_exp import LANES, exp_parts, lane_max
from metalserve.kernels.cpu.gemm import F32, sgemm
from metalserve.kernels.cpu.work_split import short_long

QUERY_BLOCK = 32  # query rows per work item (times the group's heads: the rows of one score GEMM)
_GATHER_BLOCK = 256  # keys per gather work item


@numba.njit(fastmath=True, cache=True, nogil=True, boundscheck=False)
def _softmax_masked(s, lo, hi, softcap, pow2, lanes):  # noqa: ANN001, ANN202  (numba infers the types)
    """Row `s` (scores already scaled) to exp(s - max) over `[lo, hi)`, zero outside it; returns the sum
    (the caller divides the output row by it: one pass fewer over the scores). The exp is attention.py's
    polynomial and power of two, in three contiguous loops LLVM vectorises (`pow2`: int32 scratch; `lanes`:
    fast_exp.lane_max's)."""
    if softcap > 0:
        for j in range(lo, hi):
            s[j] = softcap * np.tanh(s[j] / softcap)
    top = lane_max(s, lo, hi, lanes)
    for j in range(lo, hi):
        s[j], pow2[j] = exp_parts(s[j] - top)
    scale = pow2.view(np.float32)
    total = np.float32(0.0)
    for j in range(lo, hi):
        s[j] *= scale[j]
        total += s[j]
    s[:lo] = 0.0
    s[hi:] = 0.0
    return total


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True, boundscheck=False)
def _gather(pool, plane, table, block_size, first, count, dest):  # noqa: ANN001, ANN202
    """dest[h, j] = pool[plane, h, slot of position first + j, :dest width]."""
    heads, width = dest.shape[0], dest.shape[2]
    for b in numba.prange((count + _GATHER_BLOCK - 1) // _GATHER_BLOCK):
        for j in range(b * _GATHER_BLOCK, min(count, (b + 1) * _GATHER_BLOCK)):
            p = first + j
            slot = table[p // block_size] * block_size + p % block_size
            for h in range(heads):
                for c in range(width):
                    dest[h, j, c] = pool[plane, h, slot, c]


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True, boundscheck=False)
def chunk_attention(q, pool, table, block_size, q_first, pos0, rows, scale, window, softcap, gemm, out):  # noqa: ANN001, ANN202
    """Rows `q_first .. q_first + rows - 1` of `q` `[T, Hq, D]`, one request's consecutive positions from
    `pos0`, attended over its pages (`table`: its block ids) into the same rows of `out` `[T, Hq, Dv]`."""
    hq, d, dv = q.shape[1], q.shape[2], out.shape[2]
    hkv = pool.shape[1]
    group = hq // hkv
    first = max(0, pos0 - window + 1) if window > 0 else 0  # the first key any row sees
    count = pos0 + rows - first
    keys = np.empty((hkv, count, d), np.float32)
    values = np.empty((hkv, count, dv), np.float32)
    _gather(pool, 0, table, block_size, first, count, keys)
    _gather(pool, pool.shape[0] - 1, table, block_size, first, count, values)
    blocks = (rows + QUERY_BLOCK - 1) // QUERY_BLOCK
    items = hkv * blocks
    for k in numba.prange(items):
        item = short_long(k, items)  # a causal block's keys grow with its index
        h, b = item % hkv, item // hkv
        r0 = b * QUERY_BLOCK
        m = min(QUERY_BLOCK, rows - r0)
        p_first = pos0 + r0
        k_lo = (max(0, p_first - window + 1) if window > 0 else 0) - first
        k_hi = p_first + m - first  # keys this block's last row sees
        n = k_hi - k_lo
        queries = np.empty((m * group, d), np.float32)  # row r's heads, one after another
        for r in range(m):
            for g in range(group):
                for c in range(d):
                    queries[r * group + g, c] = q[q_first + r0 + r, h * group + g, c] * scale
        scores = np.empty((m * group, n), np.float32)
        pow2 = np.empty(n, np.int32)
        lanes = np.empty(LANES, np.float32)
        key_at = keys.ctypes.data + (h * count + k_lo) * d * F32
        sgemm(gemm, True, m * group, n, d, queries.ctypes.data, d, key_at, d, scores.ctypes.data, n)
        totals = np.empty(m * group, np.float32)
        for r in range(m):
            p = p_first + r
            lo = (max(0, p - window + 1) if window > 0 else 0) - first - k_lo
            hi = p + 1 - first - k_lo
            for g in range(group):
                totals[r * group + g] = _softmax_masked(scores[r * group + g], lo, hi, softcap, pow2, lanes)
        mixed = np.empty((m * group, dv), np.float32)
        value_at = values.ctypes.data + (h * count + k_lo) * dv * F32
        sgemm(gemm, False, m * group, dv, n, scores.ctypes.data, n, value_at, dv, mixed.ctypes.data, dv)
        for r in range(m):
            for g in range(group):
                inv = np.float32(1.0) / totals[r * group + g]
                for c in range(dv):
                    out[q_first + r0 + r, h * group + g, c] = mixed[r * group + g, c] * inv
