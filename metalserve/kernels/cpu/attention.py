"""Paged varlen attention compiled for the CPU with numba: one fused pass over each query row's pages.

On MLX's CPU backend the portable path spends most of a step's attention outside arithmetic: a page
gather that copies every key and value, a composed softmax whose `exp` runs one element at a time, and
many small matmuls. This kernel reads the pages in place; each work item is one query row and one KV
head, whose K is read once for all query heads of the group, then V once. Decode rows and prefill rows
(causal over their cached prefix) are the same loop; items alternate short and long rows so that both
cores get an even share. Scores and values take four keys at a time (independent sums instead of one
long chain), and the softmax's exp is a polynomial the compiler vectorises (libm's is called one
element at a time here). Against the one-key-at-a-time loop before, at a 500-token context with the
default model's heads: 57 -> 38 us a layer for one decode row, about 250 -> 150 us for a window of five
(bench/cpu_attention.py prints the current kernel's times).

`attend` (what the host decoder and `attend_rows` call) hands long runs of one request's rows, a prefill
chunk, to the blocked GEMM kernel in attention_prefill.py and keeps this kernel for the rest.

Contract: that of metalserve/executor/attention/base.py with the portable pool `[2, Hkv, num_slots, D]`,
float32 only; or MLA's latent pool `[1, Hkv, num_slots, D]`, whose V is K's first `Dv` channels (`out`
is `[T, Hq, Dv]`): V is always the pool's last plane, cut to `out`'s width.
"""

from __future__ import annotations

import numba
import numpy as np

from metalserve.kernels.cpu.attention_prefill import chunk_attention
from metalserve.kernels.cpu.fast_exp import LANES, exp_parts, lane_max
from metalserve.kernels.cpu.gemm import host_gemm
from metalserve.kernels.cpu.int8_dot import prefetch_row
from metalserve.kernels.cpu.numba_lock import launch_lock
from metalserve.kernels.cpu.work_split import short_long

RUN_MIN_ROWS = 64  # consecutive rows of one request at and above which they take chunk_attention


@numba.njit(fastmath=True, cache=True, nogil=True)
def _exp_rows(x, count, pow2):  # noqa: ANN001, ANN202  (numba infers the types)
    """x[g, :count] = exp(x[g, :count]) for x <= 0, in two loops the compiler vectorises."""
    for g in range(x.shape[0]):
        for j in range(count):
            x[g, j], pow2[j] = exp_parts(x[g, j])
        scale = pow2[:count].view(np.float32)
        for j in range(count):
            x[g, j] *= scale[j]


# Keys (and values) this many ahead of the four being read are asked for: a decode step reads each request's
# pages once, from the last-level cache or memory.
PREFETCH_KEYS = 16


@numba.njit(fastmath=True, cache=True, nogil=True, inline="always")
def _prefetch_keys(rows, slots, j):  # noqa: ANN001, ANN202
    """Ask for the rows `slots[j : j + 4]` of `rows` (`[slots, D]`, rows contiguous)."""
    for k in range(4):
        prefetch_row(rows, slots[j + k])


@numba.njit(fastmath=True, cache=True, nogil=True)
def _scores(q, keys, slots, head0, out):  # noqa: ANN001, ANN202
    """out[g, j] = q[head0 + g] . keys[slots[j]], four keys at a time (four independent sums)."""
    group, n, dim = out.shape[0], slots.shape[0], keys.shape[1]
    j = 0
    while j + 4 <= n:
        s0, s1, s2, s3 = slots[j], slots[j + 1], slots[j + 2], slots[j + 3]
        if j + PREFETCH_KEYS + 4 <= n:
            _prefetch_keys(keys, slots, j + PREFETCH_KEYS)
        for g in range(group):
            a0 = a1 = a2 = a3 = np.float32(0.0)
            for c in range(dim):
                qv = q[head0 + g, c]
                a0 += qv * keys[s0, c]
                a1 += qv * keys[s1, c]
                a2 += qv * keys[s2, c]
                a3 += qv * keys[s3, c]
            out[g, j] = a0
            out[g, j + 1] = a1
            out[g, j + 2] = a2
            out[g, j + 3] = a3
        j += 4
    for jj in range(j, n):
        for g in range(group):
            a = np.float32(0.0)
            for c in range(dim):
                a += q[head0 + g, c] * keys[slots[jj], c]
            out[g, jj] = a


@numba.njit(fastmath=True, cache=True, nogil=True)
def _weighted_values(p, values, slots, out):  # noqa: ANN001, ANN202
    """out[g] = sum_j p[g, j] values[slots[j], :out.shape[1]], four keys at a time."""
    group, n, dim = p.shape[0], slots.shape[0], out.shape[1]
    out[:] = 0.0
    j = 0
    while j + 4 <= n:
        s0, s1, s2, s3 = slots[j], slots[j + 1], slots[j + 2], slots[j + 3]
        if j + PREFETCH_KEYS + 4 <= n:
            _prefetch_keys(values, slots, j + PREFETCH_KEYS)
        for g in range(group):
            p0, p1, p2, p3 = p[g, j], p[g, j + 1], p[g, j + 2], p[g, j + 3]
            for c in range(dim):
                out[g, c] += p0 * values[s0, c] + p1 * values[s1, c] + p2 * values[s2, c] + p3 * values[s3, c]
        j += 4
    for jj in range(j, n):
        for g in range(group):
            for c in range(dim):
                out[g, c] += p[g, jj] * values[slots[jj], c]


@numba.njit(fastmath=True, cache=True, nogil=True)
def _softmax_rows(scores, n, scale, softcap, sinks, use_sinks, head0, pow2, tops):  # noqa: ANN001, ANN202
    """Each row's first n scores, scaled (and soft-capped), to probabilities in place; a sink is a
    virtual key with logit sinks[head0 + g] and a zero value."""
    group = scores.shape[0]
    for g in range(group):
        for j in range(n):
            s = scores[g, j] * scale
            if softcap > 0:
                s = softcap * np.tanh(s / softcap)
            scores[g, j] = s
    lanes = np.empty(LANES, np.float32)
    for g in range(group):
        top = lane_max(scores[g], 0, n, lanes)
        if use_sinks:
            top = max(top, sinks[head0 + g])
        tops[g] = top
        for j in range(n):
            scores[g, j] -= top
    _exp_rows(scores, n, pow2)
    for g in range(group):
        total = np.float32(0.0)
        for j in range(n):
            total += scores[g, j]
        if use_sinks:
            total += np.exp(sinks[head0 + g] - tops[g])
        inv = np.float32(1.0) / total
        for j in range(n):
            scores[g, j] *= inv


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _attention_kernel(  # numba infers the types
    q, pool, block_tables, row_req, row_pos, block_size, scale, window, softcap, sinks, use_sinks, out
):
    total_q, num_q_heads = q.shape[0], q.shape[1]
    num_kv_heads = pool.shape[1]
    value_plane = pool.shape[0] - 1
    group = num_q_heads // num_kv_heads
    items = total_q * num_kv_heads
    for k in numba.prange(items):
        idx = short_long(k, items)  # rows sorted short to long
        row, h = idx // num_kv_heads, idx % num_kv_heads
        r, last = row_req[row], row_pos[row]
        first = max(0, last + 1 - window) if window > 0 else 0
        n = last + 1 - first
        # Each key's slot, stepping through the blocks (a division per key cost as much as its dot).
        slots = np.empty(n, np.int64)
        block, offset = first // block_size, first % block_size
        for j in range(n):
            slots[j] = block_tables[r, block] * block_size + offset
            offset += 1
            if offset == block_size:
                block, offset = block + 1, 0
        scores = np.empty((group, n), np.float32)
        pow2 = np.empty(n, np.int32)
        tops = np.empty(group, np.float32)
        _scores(q[row], pool[0, h], slots, h * group, scores)
        _softmax_rows(scores, n, scale, softcap, sinks, use_sinks, h * group, pow2, tops)
        _weighted_values(scores, pool[value_plane, h], slots, out[row, h * group : (h + 1) * group])


@numba.njit(fastmath=True, cache=True, nogil=True, boundscheck=False)
def attend(q, pool, block_tables, row_req, row_pos, block_size, scale, window, softcap, sinks, use_sinks, gemm, out):  # noqa: ANN001, ANN202
    """`_attention_kernel`'s contract (attention.py), with runs of at least RUN_MIN_ROWS consecutive rows
    of one request taken by `chunk_attention` where `gemm` is usable and the layer has no sinks."""
    total = q.shape[0]
    if use_sinks or not gemm.usable or total < RUN_MIN_ROWS:
        _attention_kernel(
            q, pool, block_tables, row_req, row_pos, block_size, scale, window, softcap, sinks, use_sinks, out
        )
        return
    short = np.empty(total, np.int64)
    shorts = 0
    i = 0
    while i < total:
        j = i + 1
        while j < total and row_req[j] == row_req[i] and row_pos[j] == row_pos[j - 1] + 1:
            j += 1
        if j - i >= RUN_MIN_ROWS:
            table = block_tables[row_req[i]]
            chunk_attention(q, pool, table, block_size, i, row_pos[i], j - i, scale, window, softcap, gemm, out)
        else:
            for k in range(i, j):
                short[shorts] = k
                shorts += 1
        i = j
    if shorts == 0:
        return
    rows = short[:shorts]
    part = np.empty((shorts, q.shape[1], out.shape[2]), np.float32)
    rows_req, rows_pos = row_req[rows], row_pos[rows]
    _attention_kernel(
        q[rows], pool, block_tables, rows_req, rows_pos, block_size, scale, window, softcap, sinks, use_sinks, part
    )
    for k in range(shorts):
        out[rows[k]] = part[k]


def query_rows(cu_seqlens_q: np.ndarray, seq_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each query row's request and position: request i's rows sit at `seq_len - q_len ... seq_len - 1`."""
    cu = np.asarray(cu_seqlens_q, np.int64)
    q_lens = np.diff(cu)
    first_pos = np.asarray(seq_lens, np.int64) - q_lens
    row_req = np.repeat(np.arange(len(q_lens)), q_lens)
    row_pos = np.repeat(first_pos - cu[:-1], q_lens) + np.arange(int(cu[-1]))
    return row_req.astype(np.int32), row_pos.astype(np.int32)


def paged_attention(
    q: np.ndarray,
    pool: np.ndarray,
    block_tables: np.ndarray,
    cu_seqlens_q: np.ndarray,
    seq_lens: np.ndarray,
    *,
    block_size: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    """Attention of every query row over its request's pages; returns `[total_q, Hq, D]` float32."""
    row_req, row_pos = query_rows(cu_seqlens_q, seq_lens)
    return attend_rows(
        q,
        pool,
        block_tables,
        row_req,
        row_pos,
        block_size=block_size,
        scale=scale,
        sliding_window=sliding_window,
        softcap=softcap,
        sinks=sinks,
    )


def attend_rows(
    q: np.ndarray,
    pool: np.ndarray,
    block_tables: np.ndarray,
    row_req: np.ndarray,
    row_pos: np.ndarray,
    *,
    block_size: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: np.ndarray | None = None,
    value_dim: int | None = None,
) -> np.ndarray:
    """`paged_attention` with each row's request and position given (see `query_rows`); `value_dim`: the
    latent pool's V width (MLA), which the pool's plane count must agree with."""
    if q.dtype != np.float32 or pool.dtype != np.float32:
        raise TypeError(f"the CPU attention kernel takes float32 only, got q {q.dtype} and pool {pool.dtype}")
    num_q_heads = q.shape[1]
    if num_q_heads % pool.shape[1]:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {pool.shape[1]} KV heads")
    if (pool.shape[0] == 1) != (value_dim is not None):
        raise ValueError(f"a pool of {pool.shape[0]} planes with value_dim {value_dim}: K/V and latent mixed up")
    out = np.empty((*q.shape[:2], value_dim or q.shape[2]), np.float32)
    sink_logits = np.zeros(num_q_heads, np.float32) if sinks is None else np.ascontiguousarray(sinks, np.float32)
    with launch_lock:
        attend(  # a prefill chunk's rows by GEMMs (attention_prefill.py), the rest row by row
            np.ascontiguousarray(q),
            pool,
            np.ascontiguousarray(block_tables, np.int32),
            row_req,
            row_pos,
            block_size,
            np.float32(scale),
            sliding_window or 0,
            np.float32(softcap or 0.0),
            sink_logits,
            sinks is not None,
            host_gemm(),
            out,
        )
    return out


def warm_up() -> None:
    """One tiny call: numba loads the dense kernel for the argument types every real call passes
    (float32 C arrays, int32 tables and rows, Python ints), so the first step does not."""
    q = np.zeros((1, 1, 8), np.float32)
    pool = np.zeros((2, 1, 16, 8), np.float32)
    paged_attention(q, pool, np.zeros((1, 1), np.int32), np.array([0, 1]), np.array([1]), block_size=16, scale=1.0)


def write_kv(pool: np.ndarray, k: np.ndarray, v: np.ndarray | None, slot_mapping: np.ndarray) -> None:
    """Write new K/V `[T, Hkv, D]` into the pool `[2, Hkv, num_slots, D]` in place, at `slot_mapping` `[T]`;
    `v` None: K alone into a latent pool `[1, Hkv, num_slots, D]`."""
    if (v is None) != (pool.shape[0] == 1):
        raise ValueError(f"a pool of {pool.shape[0]} planes cannot take {'K alone' if v is None else 'K and V'}")
    pool[0][:, slot_mapping] = k.transpose(1, 0, 2)
    if v is not None:
        pool[1][:, slot_mapping] = v.transpose(1, 0, 2)
