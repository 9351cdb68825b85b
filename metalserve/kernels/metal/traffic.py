"""K/V bytes the attention kernels read, computed from the request shapes (an analytic model).

tests/kernels/test_traffic.py checks it against the emulator's exact per-buffer byte counts on small
shapes; bench/kernel_traffic.py uses it for shapes too large to emulate (16K-token prefills).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from metalserve.kernels.metal.tiled import tiling


@dataclass(frozen=True)
class Heads:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    itemsize: int  # bytes per pool element: the model's dtype, or 1 for int8 pages (the codes)
    int8: bool = False  # int8 pages: each K or V vector also has a float16 scale (scale_loads)

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    def per_key(self) -> int:
        """Bytes of one key's K and V over all KV heads."""
        return 2 * self.num_kv_heads * self.head_dim * self.itemsize


def _positions(q_len: int, kv_len: int) -> np.ndarray:
    return np.arange(kv_len - q_len, kv_len, dtype=np.int64)


def _first_key(pos: np.ndarray, window: int | None) -> np.ndarray:
    return np.maximum(0, pos - window + 1) if window else np.zeros_like(pos)


def decode_kernel_keys(reqs: Sequence[tuple[int, int]], window: int | None = None) -> int:
    """Keys read by the one-token kernel: each query token reads all the keys it sees (split-KV
    partitions are disjoint, so splitting reads the same)."""
    total = 0
    for q_len, kv_len in reqs:
        pos = _positions(q_len, kv_len)
        total += int((pos + 1 - _first_key(pos, window)).sum())
    return total


def tiled_kernel_keys(reqs: Sequence[tuple[int, int]], tile_q: int, window: int | None = None) -> int:
    """Keys read by the tiled kernel: each query tile reads the union of its rows' keys once, which is
    also the minimum for that tiling (every K/V byte a tile needs, read once per tile)."""
    total = 0
    for q_len, kv_len in reqs:
        pos = _positions(q_len, kv_len)
        first, last = pos[::tile_q], pos[tile_q - 1 :: tile_q]
        last = np.append(last, pos[-1]) if len(last) < len(first) else last
        total += int((last + 1 - _first_key(first, window)).sum())
    return total


def once_per_request_keys(reqs: Sequence[tuple[int, int]], window: int | None = None) -> int:
    """The absolute floor: every key a request's queries see, read once for the whole request."""
    total = 0
    for q_len, kv_len in reqs:
        pos = _positions(q_len, kv_len)
        total += int(pos[-1] + 1 - _first_key(pos[:1], window)[0])
    return total


def kv_bytes(reqs: Sequence[tuple[int, int]], heads: Heads, kernel: str, window: int | None = None) -> int:
    """K/V bytes (the pools' elements: int8 pages' codes) one layer's attention reads with `kernel`
    ("decode", "tiled" or "once"); int8 pages' scales: `scale_loads`."""
    return _keys(reqs, heads, kernel, window) * heads.per_key()


SCALE_BYTES = 2  # one float16 per K or V vector of int8 pages


def scale_loads(reqs: Sequence[tuple[int, int]], heads: Heads, kernel: str, window: int | None = None) -> int:
    """Bytes of int8 pages' scales the kernel's threads load (0 for float pages): the decode kernel's 32
    lanes each load their key's scale, the tiled kernel's loaders one per 4 codes they dequantize. Loads
    of one scale by many threads hit the same cache line: the memory reads it `SCALE_BYTES` per vector."""
    if not heads.int8:
        return 0
    per_vector = {"decode": 32, "tiled": heads.head_dim // 4, "once": 1}[kernel]
    return _keys(reqs, heads, kernel, window) * 2 * heads.num_kv_heads * per_vector * SCALE_BYTES


def _keys(reqs: Sequence[tuple[int, int]], heads: Heads, kernel: str, window: int | None) -> int:
    if kernel == "decode":
        keys = decode_kernel_keys(reqs, window)
    elif kernel == "tiled":
        t = tiling(heads.group, heads.head_dim)
        if t is None:
            raise ValueError(f"no query tile for G={heads.group}, D={heads.head_dim}")
        keys = tiled_kernel_keys(reqs, t.tile_q, window)
    elif kernel == "once":
        keys = once_per_request_keys(reqs, window)
    else:
        raise ValueError(f"unknown kernel {kernel!r}")
    return keys
