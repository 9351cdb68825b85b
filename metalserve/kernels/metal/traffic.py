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
    itemsize: int  # bytes per element of the model's dtype (float pages)
    storage: str = "auto"  # "int8" / "q4" pages: codes, plus float16 scales (and q4's biases): scale_loads

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    def per_key(self, kernel: str = "tiled") -> int:
        """Bytes of one key's K and V over all KV heads that `kernel` loads: the elements of float pages,
        int8's codes (1 byte each), q4's bytes of two codes (the decode kernel's lanes each load the byte
        of their own channel, two lanes the same byte: D loads per vector there)."""
        per_vector = {"auto": self.head_dim * self.itemsize, "int8": self.head_dim}.get(self.storage, 0)
        if self.storage == "q4":
            per_vector = self.head_dim if kernel == "decode" else self.head_dim // 2
        return 2 * self.num_kv_heads * per_vector


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
    return _keys(reqs, heads, kernel, window) * heads.per_key(kernel)


SCALE_BYTES = 2  # one float16 per K or V vector of int8 pages


def scale_loads(reqs: Sequence[tuple[int, int]], heads: Heads, kernel: str, window: int | None = None) -> int:
    """Bytes of quantized pages' scales (and q4's biases) the kernel's threads load (0 for float pages):
    int8: the decode kernel's 32 lanes each load their key's scale, the tiled kernel's loaders one per
    4 codes; q4: a scale and a bias per channel (decode) or per 4 codes (tiled). Loads of one scale by
    many threads hit the same cache line: memory reads each scale once per vector and group."""
    if heads.storage == "auto":
        return 0
    loads = {"decode": 32, "tiled": heads.head_dim // 4, "once": 1}[kernel]
    if heads.storage == "q4":
        loads = 2 * {"decode": heads.head_dim, "tiled": heads.head_dim // 4, "once": 1}[kernel]
    return _keys(reqs, heads, kernel, window) * 2 * heads.num_kv_heads * loads * SCALE_BYTES


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
