"""A block's pages out of and into every backend's pools, in one layout on the host.

On the host a block is one array per pool tensor, `[planes, kv_heads, block_size, head_dim]` (planes:
K and V, or MLA's latent alone), whatever the backend: the MLX and CPU pools `[planes, H, slots, D]`
slice on their slot axis, the kernel pools `[slots, H, D]` (K and V apart) are transposed into it.
bfloat16, which NumPy lacks, travels as its bits (uint16) and is named in the block's dtype tag.
Quantized MLX pools (--kv-cache-dtype int8/q4) store their codes as `kv.N` and the float16 scales (and
q4's biases) beside them as `kv.N.scales` / `kv.N.biases`: every one of those arrays has its slots on axis 2.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

HostBlock = dict[str, np.ndarray]


# The three pool kinds, told apart by their fields (importing the CPU backend would load numba):
# HostKV (`pool` and its NumPy view `host`), PortableKV (`pool`), LayerKV (`k` and `v`).
def _is_host(cache: Any) -> bool:
    return isinstance(getattr(cache, "host", None), np.ndarray)


def _is_portable(cache: Any) -> bool:
    return not _is_host(cache) and isinstance(getattr(cache, "pool", None), mx.array)


def _quant_parts(cache: Any) -> dict[str, mx.array] | None:
    """A quantized MLX pool's arrays by suffix (codes "", scales, biases), or None for a float pool."""
    pool = getattr(cache, "pool", None)
    if _is_host(cache) or pool is None or isinstance(pool, mx.array):
        return None
    parts = {"": pool.codes, ".scales": pool.scales}
    if pool.biases is not None:
        parts[".biases"] = pool.biases
    return parts


def _is_quant(cache: Any) -> bool:
    return _quant_parts(cache) is not None


def _is_kernel(cache: Any) -> bool:
    # Float pools only: the Metal backend's quantized pools (scales of their own) are not stored yet.
    return (
        isinstance(getattr(cache, "k", None), mx.array)
        and isinstance(getattr(cache, "v", None), mx.array)
        and getattr(cache, "k_scales", None) is None
    )


def tensor_name(index: int) -> str:
    return f"kv.{index}"


def dtype_tag(caches: Sequence[Any]) -> str:
    """The pools' dtype, as stored with every block (a block of another dtype is a miss)."""
    return str(caches[0].arrays()[0].dtype).removeprefix("mlx.core.") if caches else "none"


def supported(cache: Any) -> bool:
    return _is_host(cache) or _is_portable(cache) or _is_kernel(cache) or _is_quant(cache)


def to_host(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.array(a)


def to_device(a: np.ndarray, dtype: mx.Dtype) -> mx.array:
    if dtype == mx.bfloat16:
        return mx.array(a).view(mx.bfloat16)
    return mx.array(a)


def _slots(block_ids: Sequence[int], block_size: int) -> np.ndarray:
    base = np.asarray(block_ids, dtype=np.int64)[:, None] * block_size
    return (base + np.arange(block_size, dtype=np.int64)).reshape(-1)


def _gather(cache: Any, slots: np.ndarray) -> np.ndarray:
    """`[planes, H, len(slots), D]` on the host."""
    if _is_host(cache):
        return cache.host[:, :, slots, :]
    if _is_portable(cache):
        return to_host(mx.take(cache.pool, mx.array(slots), axis=2))
    idx = mx.array(slots)
    k, v = (to_host(mx.take(a, idx, axis=0)) for a in (cache.k, cache.v))
    return np.stack([k, v]).transpose(0, 2, 1, 3)


def read_blocks(caches: Sequence[Any], block_ids: Sequence[int], block_size: int) -> list[HostBlock]:
    """Copies of the blocks' pages, one dict per block (call on the thread that owns the pools, after
    the step's arrays are evaluated)."""
    n = len(block_ids)
    if not n:
        return []
    slots = _slots(block_ids, block_size)
    out: list[HostBlock] = [{} for _ in range(n)]
    idx = mx.array(slots)
    for j, cache in enumerate(caches):
        parts = _quant_parts(cache)
        gathered = (
            {tensor_name(j) + suffix: np.array(mx.take(a, idx, axis=2)) for suffix, a in parts.items()}
            if parts is not None
            else {tensor_name(j): _gather(cache, slots)}
        )
        for name, pages in gathered.items():
            p, h, _, d = pages.shape
            pages = pages.reshape(p, h, n, block_size, d)
            for b in range(n):
                out[b][name] = np.ascontiguousarray(pages[:, :, b])
    return out


def expected_shapes(caches: Sequence[Any], block_size: int) -> dict[str, tuple[int, ...]]:
    """The host block's tensors and shapes for these pools: a stored block must match them."""
    shapes: dict[str, tuple[int, ...]] = {}
    for j, cache in enumerate(caches):
        parts = _quant_parts(cache)
        if parts is not None:
            for suffix, a in parts.items():
                p, h, _, d = a.shape
                shapes[tensor_name(j) + suffix] = (p, h, block_size, d)
        elif _is_kernel(cache):
            _, h, d = cache.k.shape
            shapes[tensor_name(j)] = (2, h, block_size, d)
        else:
            p, h, _, d = cache.arrays()[0].shape
            shapes[tensor_name(j)] = (p, h, block_size, d)
    return shapes


def write_blocks(caches: Sequence[Any], block_ids: Sequence[int], blocks: Sequence[HostBlock], block_size: int) -> None:
    """Put host blocks (as `read_blocks` made them) into the pools at `block_ids`."""
    if not block_ids:
        return
    slots = _slots(block_ids, block_size)
    written: list[mx.array] = []
    for j, cache in enumerate(caches):
        parts = _quant_parts(cache)
        if parts is not None:
            idx = mx.array(slots)
            for suffix, a in parts.items():
                a[:, :, idx, :] = mx.array(np.concatenate([b[tensor_name(j) + suffix] for b in blocks], axis=2))
                written.append(a)
            continue
        pages = np.concatenate([b[tensor_name(j)] for b in blocks], axis=2)  # [planes, H, n*bs, D]
        if _is_host(cache):
            cache.host[:, :, slots, :] = pages  # through the view: the numba kernel reads this buffer
        elif _is_portable(cache):
            cache.pool[:, :, mx.array(slots), :] = to_device(pages, cache.pool.dtype)
            written.append(cache.pool)
        else:
            idx = mx.array(slots)
            cache.k[idx] = to_device(np.ascontiguousarray(pages[0].transpose(1, 0, 2)), cache.k.dtype)
            cache.v[idx] = to_device(np.ascontiguousarray(pages[1].transpose(1, 0, 2)), cache.v.dtype)
            written += [cache.k, cache.v]
    if written:
        mx.eval(written)
