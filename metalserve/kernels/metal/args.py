"""The Metal paged-attention kernels' arguments (the backend contract's, see reference.py), checked once.

Their own module so that the launch builders (paged.py, tiled.py) both read them without importing
each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

HEAD_DIMS = (64, 80, 96, 128, 256)
BLOCK_SIZES = (8, 16, 32)
DTYPES = (mx.float16, mx.bfloat16, mx.float32)


@dataclass(frozen=True)
class PagedArgs:
    """The contract's arguments, checked once."""

    q: mx.array
    k_pool: mx.array
    v_pool: mx.array
    block_tables: mx.array
    cu_seqlens_q: mx.array
    seq_lens: mx.array
    block_size: int
    scale: float
    sliding_window: int | None
    softcap: float | None
    sinks: mx.array | None
    # int8 pages (--kv-cache-dtype int8): the pools hold int8 codes and these one float16 scale per slot
    # and KV head, `[num_slots, Hkv]`; attention then computes in q's dtype.
    k_scales: mx.array | None = None
    v_scales: mx.array | None = None

    def __post_init__(self) -> None:
        _validate(self)
        if self.quantized:
            _validate_int8(self)

    @property
    def quantized(self) -> bool:
        return self.k_pool.dtype == mx.int8

    @property
    def compute_dtype(self) -> mx.Dtype:
        """The dtype of q and of the output: the pools' own, or q's where the pools hold codes."""
        return self.q.dtype if self.quantized else self.k_pool.dtype

    def scale_arrays(self) -> tuple[mx.array, mx.array]:
        """The kernels' k_scales / v_scales inputs: the pools' scales, or a 1-element placeholder."""
        if self.k_scales is None or self.v_scales is None:
            placeholder = mx.ones((1,), mx.float16)
            return placeholder, placeholder
        return self.k_scales.reshape(-1), self.v_scales.reshape(-1)


def _validate(a: PagedArgs) -> None:
    if a.q.ndim != 3 or a.k_pool.ndim != 3 or a.k_pool.shape != a.v_pool.shape:
        raise ValueError("q must be [total_q, Hq, D] and k_pool, v_pool the same [num_slots, Hkv, D]")
    hq, d = a.q.shape[1], a.q.shape[2]
    hkv = a.k_pool.shape[1]
    if d != a.k_pool.shape[2] or d not in HEAD_DIMS:
        raise ValueError(f"head dim must match between q and the pools and be one of {HEAD_DIMS}, got {d}")
    if hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if a.block_size not in BLOCK_SIZES:
        raise ValueError(f"block_size must be one of {BLOCK_SIZES}, got {a.block_size}")
    if a.k_pool.dtype not in (*DTYPES, mx.int8) or a.v_pool.dtype != a.k_pool.dtype:
        raise ValueError(f"the pools must share one dtype of {DTYPES}, got {a.k_pool.dtype}, {a.v_pool.dtype}")
    if a.block_tables.ndim != 2 or a.cu_seqlens_q.shape != (a.seq_lens.shape[0] + 1,):
        raise ValueError("block_tables must be [num_reqs, max_blocks] and cu_seqlens_q [num_reqs + 1]")
    if a.block_tables.shape[0] != a.seq_lens.shape[0]:
        raise ValueError("block_tables needs one row per request")
    if a.sliding_window is not None and a.sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {a.sliding_window}")
    if a.softcap is not None and not a.softcap > 0:
        raise ValueError(f"softcap must be > 0, got {a.softcap}")
    if a.sinks is not None and a.sinks.shape != (hq,):
        raise ValueError(f"sinks must be [Hq] = [{hq}], got {a.sinks.shape}")


def _validate_int8(a: PagedArgs) -> None:
    slots, hkv = a.k_pool.shape[0], a.k_pool.shape[1]
    for name, scales in (("k_scales", a.k_scales), ("v_scales", a.v_scales)):
        if scales is None or scales.size != slots * hkv or scales.dtype != mx.float16:
            raise ValueError(f"int8 pools need {name}: float16 [num_slots, Hkv] = [{slots}, {hkv}]")
    if a.q.dtype not in DTYPES:
        raise ValueError(f"q must be one of {DTYPES}, got {a.q.dtype}")
