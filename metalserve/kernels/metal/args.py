"""The Metal paged-attention kernels' arguments (the backend contract's: executor/attention/base.py), checked once.

Their own module so that the launch builders (paged.py, tiled.py) both read them without importing
each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from metalserve.kvcache.specs import BLOCK_SIZES

HEAD_DIMS = (64, 80, 96, 128, 256)
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
    # and KV head, `[num_slots, Hkv]`. q4 pages: uint8 pools `[num_slots, Hkv, D/2]` (two codes a byte,
    # the even channel in the low nibble), float16 scales and biases `[num_slots, Hkv, D/group]`
    # (kernels/cpu/kv_quant.py). Attention then computes in q's dtype.
    k_scales: mx.array | None = None
    v_scales: mx.array | None = None
    k_biases: mx.array | None = None
    v_biases: mx.array | None = None

    def __post_init__(self) -> None:
        _validate(self)
        if self.quantized:
            _validate_quantized(self)

    @property
    def storage(self) -> str:
        """The pools' storage: "auto" (floats), "int8" or "q4" (uint8 codes), from their dtype."""
        return {mx.int8: "int8", mx.uint8: "q4"}.get(self.k_pool.dtype, "auto")

    @property
    def quantized(self) -> bool:
        return self.storage != "auto"

    @property
    def group_size(self) -> int:
        """q4 pages' channels per scale and bias (0 for other pools)."""
        if self.storage != "q4" or self.k_scales is None:
            return 0
        return int(self.q.shape[2] // (self.k_scales.size // (self.k_pool.shape[0] * self.k_pool.shape[1])))

    @property
    def compute_dtype(self) -> mx.Dtype:
        """The dtype of q and of the output: the pools' own, or q's where the pools hold codes."""
        return self.q.dtype if self.quantized else self.k_pool.dtype

    def scale_arrays(self) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """The kernels' k_scales, v_scales, k_biases, v_biases inputs: the pools' own, flat, or a
        1-element placeholder where the pools have none."""
        placeholder = mx.ones((1,), mx.float16)
        arrays = (self.k_scales, self.v_scales, self.k_biases, self.v_biases)
        return tuple(placeholder if a is None else a.reshape(-1) for a in arrays)  # type: ignore[return-value]


def _validate(a: PagedArgs) -> None:
    if a.q.ndim != 3 or a.k_pool.ndim != 3 or a.k_pool.shape != a.v_pool.shape:
        raise ValueError("q must be [total_q, Hq, D] and k_pool, v_pool the same [num_slots, Hkv, D]")
    hq, d = a.q.shape[1], a.q.shape[2]
    hkv = a.k_pool.shape[1]
    width = d // 2 if a.k_pool.dtype == mx.uint8 else d  # q4: two codes a byte
    if width != a.k_pool.shape[2] or d not in HEAD_DIMS:
        raise ValueError(f"head dim must match between q and the pools and be one of {HEAD_DIMS}, got {d}")
    if hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if a.block_size not in BLOCK_SIZES:
        raise ValueError(f"block_size must be one of {BLOCK_SIZES}, got {a.block_size}")
    if a.k_pool.dtype not in (*DTYPES, mx.int8, mx.uint8) or a.v_pool.dtype != a.k_pool.dtype:
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


def _validate_quantized(a: PagedArgs) -> None:
    slots, hkv = a.k_pool.shape[0], a.k_pool.shape[1]
    per_vector = 1
    named = [("k_scales", a.k_scales), ("v_scales", a.v_scales)]
    if a.storage == "q4":
        named += [("k_biases", a.k_biases), ("v_biases", a.v_biases)]
        per_vector = a.k_scales.size // (slots * hkv) if a.k_scales is not None else 0
        if per_vector < 1 or a.q.shape[2] % per_vector or (a.q.shape[2] // per_vector) % 4:
            raise ValueError("q4 pools need k_scales of [num_slots, Hkv, D/group], groups of a multiple of 4")
    for name, arr in named:
        if arr is None or arr.size != slots * hkv * per_vector or arr.dtype != mx.float16:
            raise ValueError(f"{a.storage} pools need {name}: float16 [num_slots, Hkv] = [{slots}, {hkv}] per group")
    if a.q.dtype not in DTYPES:
        raise ValueError(f"q must be one of {DTYPES}, got {a.q.dtype}")
