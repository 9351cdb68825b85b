"""Decode attention compiled for the CPU with numba: one fused pass over each request's pages.

On MLX's CPU backend the portable path's decode attention is a page gather plus a composed softmax
attention, each a dozen ops that copy every key and value of the batch; this kernel reads each page once,
in place, two requests' heads at a time on the two cores. It serves single-query rows only: prefill
chunks stay on the portable path, whose matmuls are large enough for BLAS.

Contract (the one of metalserve/kernels/reference.py, for single-query rows, float32 only):
`q` `[R, Hq, D]`, `pool` `[2, Hkv, num_slots, D]` (the portable layout), `block_tables` `[R, width]`,
`seq_lens` `[R]` including the new token, which is each row's query position + 1.
"""

from __future__ import annotations

import threading

import numba
import numpy as np

# numba's default (workqueue) threading layer must not be entered from two threads at once.
_launch_lock = threading.Lock()


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _decode_kernel(  # numba infers the types
    q, pool, block_tables, seq_lens, block_size, scale, window, softcap, sinks, use_sinks, out
):
    num_reqs, num_q_heads, head_dim = q.shape
    num_kv_heads = pool.shape[1]
    group = num_q_heads // num_kv_heads
    for item in numba.prange(num_reqs * num_kv_heads):
        r = item // num_kv_heads
        h = item % num_kv_heads
        length = seq_lens[r]
        first = max(0, length - window) if window > 0 else 0
        n = length - first
        scores = np.empty((group, n), np.float32)
        for j in range(n):
            pos = first + j
            slot = block_tables[r, pos // block_size] * block_size + pos % block_size
            for g in range(group):
                acc = np.float32(0.0)
                for c in range(head_dim):
                    acc += q[r, h * group + g, c] * pool[0, h, slot, c]
                s = acc * scale
                if softcap > 0:
                    s = softcap * np.tanh(s / softcap)
                scores[g, j] = s
        for g in range(group):
            top = scores[g, 0]
            for j in range(1, n):
                top = max(top, scores[g, j])
            if use_sinks:  # a virtual key with logit sinks[head] and a zero value
                top = max(top, sinks[h * group + g])
            total = np.float32(0.0)
            for j in range(n):
                e = np.exp(scores[g, j] - top)
                scores[g, j] = e
                total += e
            if use_sinks:
                total += np.exp(sinks[h * group + g] - top)
            inv = np.float32(1.0) / total
            for j in range(n):
                scores[g, j] *= inv
        acc_out = np.zeros((group, head_dim), np.float32)
        for j in range(n):
            pos = first + j
            slot = block_tables[r, pos // block_size] * block_size + pos % block_size
            for g in range(group):
                p = scores[g, j]
                for c in range(head_dim):
                    acc_out[g, c] += p * pool[1, h, slot, c]
        for g in range(group):
            for c in range(head_dim):
                out[r, h * group + g, c] = acc_out[g, c]


def decode_attention(
    q: np.ndarray,
    pool: np.ndarray,
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    *,
    block_size: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    """Attention of one query per request over its pages; returns `[R, Hq, D]` float32."""
    if q.dtype != np.float32 or pool.dtype != np.float32:
        raise TypeError(f"the CPU decode kernel takes float32 only, got q {q.dtype} and pool {pool.dtype}")
    num_q_heads = q.shape[1]
    if num_q_heads % pool.shape[1]:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {pool.shape[1]} KV heads")
    out = np.empty(q.shape, np.float32)
    sink_logits = np.zeros(num_q_heads, np.float32) if sinks is None else np.ascontiguousarray(sinks, np.float32)
    with _launch_lock:
        _decode_kernel(
            np.ascontiguousarray(q), pool, np.ascontiguousarray(block_tables, np.int32),
            np.ascontiguousarray(seq_lens, np.int32), block_size, np.float32(scale), sliding_window or 0,
            np.float32(softcap or 0.0), sink_logits, sinks is not None, out,
        )  # fmt: skip
    return out


def write_kv(pool: np.ndarray, k: np.ndarray, v: np.ndarray, slot_mapping: np.ndarray) -> None:
    """Write new K/V `[T, Hkv, D]` into the pool `[2, Hkv, num_slots, D]` in place, at `slot_mapping` `[T]`."""
    pool[0][:, slot_mapping] = k.transpose(1, 0, 2)
    pool[1][:, slot_mapping] = v.transpose(1, 0, 2)
