"""A block's pages out of and into every backend's pools, in one layout on the host.

On the host a block is one array per pool tensor, `[planes, kv_heads, block_size, head_dim]` (planes:
K and V, or MLA's latent alone), whatever the backend: the MLX and CPU pools `[planes, H, slots, D]`
slice on their slot axis, the kernel pools `[slots, H, D]` (K and V apart) are transposed into it.
bfloat16, which NumPy lacks, travels as its bits (uint16) and is named in the block's dtype tag.
Quantized pools (--kv-cache-dtype int8/q4) store their codes as `kv.N` and the float16 scales (and
q4's biases) beside them as `kv.N.scales` / `kv.N.biases`, each `[2, H, block_size, width]`: QuantPool
(MLX ops, CPU) slices its arrays on axis 2; the Metal backend's slot-major codes, scales and biases
(LayerKV: int8's scales `[slots, H]` get a width of 1) are transposed into the same layout. Both write
them with kv_quant.quantize in the same rotated basis, so a block means the same to either backend.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
    return isinstance(getattr(cache, "k", None), mx.array) and isinstance(getattr(cache, "v", None), mx.array)


def _kernel_parts(cache: Any) -> dict[str, tuple[mx.array, mx.array]]:
    """A kernel pool's slot-major (K, V) array pairs by suffix: the pages (float, or codes) and, for
    quantized pages, their scales and q4's biases."""
    parts = {"": (cache.k, cache.v)}
    for suffix, k_name, v_name in ((".scales", "k_scales", "v_scales"), (".biases", "k_biases", "v_biases")):
        k, v = getattr(cache, k_name, None), getattr(cache, v_name, None)
        if (k is None) != (v is None):
            raise ValueError(f"a kernel pool with {k_name} and {v_name} not both set")
        if k is not None:
            parts[suffix] = (k, v)
    return parts


def _gather_pair(pair: tuple[mx.array, mx.array], idx: mx.array) -> np.ndarray:
    """Slot-major K and V (`[slots, H, width]`, or int8 scales' `[slots, H]`) as `[2, H, len(idx), width]`."""
    k, v = (to_host(mx.take(a, idx, axis=0)) for a in pair)
    pages = np.stack([k, v])
    if pages.ndim == 3:  # one scale per slot and head: the QuantPool's width of 1
        pages = pages[..., None]
    return pages.transpose(0, 2, 1, 3)


def _scatter_pair(pair: tuple[mx.array, mx.array], idx: mx.array, pages: np.ndarray) -> None:
    """The inverse of `_gather_pair`: `pages` `[2, H, len(idx), width]` into the slot-major arrays."""
    for plane, a in enumerate(pair):
        rows = pages[plane].transpose(1, 0, 2)
        a[idx] = to_device(np.ascontiguousarray(rows if a.ndim == 3 else rows[..., 0]), a.dtype)


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


def _gather(cache: Any, j: int, slots: np.ndarray) -> dict[str, np.ndarray]:
    """Pool tensor `j`'s host arrays by name, each `[planes, H, len(slots), width]`."""
    idx = mx.array(slots)
    parts = _quant_parts(cache)
    if parts is not None:
        return {tensor_name(j) + suffix: np.array(mx.take(a, idx, axis=2)) for suffix, a in parts.items()}
    if _is_host(cache):
        return {tensor_name(j): cache.host[:, :, slots, :]}
    if _is_portable(cache):
        return {tensor_name(j): to_host(mx.take(cache.pool, idx, axis=2))}
    return {tensor_name(j) + suffix: _gather_pair(pair, idx) for suffix, pair in _kernel_parts(cache).items()}


def read_blocks(caches: Sequence[Any], block_ids: Sequence[int], block_size: int) -> list[HostBlock]:
    """Copies of the blocks' pages, one dict per block (call on the thread that owns the pools, after
    the step's arrays are evaluated)."""
    n = len(block_ids)
    if not n:
        return []
    slots = _slots(block_ids, block_size)
    out: list[HostBlock] = [{} for _ in range(n)]
    for j, cache in enumerate(caches):
        for name, pages in _gather(cache, j, slots).items():
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
            for suffix, (k, _) in _kernel_parts(cache).items():
                width = k.shape[2] if k.ndim == 3 else 1
                shapes[tensor_name(j) + suffix] = (2, k.shape[1], block_size, width)
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
        written += _scatter(cache, slots, lambda name: np.concatenate([b[name] for b in blocks], axis=2), j)
    if written:
        mx.eval(written)


def _scatter(cache: Any, slots: np.ndarray, pages_of: Callable[[str], np.ndarray], j: int) -> list[mx.array]:
    """Pool tensor `j`'s pages (`pages_of(name)`: `[planes, H, len(slots), width]`) into its arrays at
    `slots`; returns the MLX arrays written (to evaluate)."""
    idx = mx.array(slots)
    parts = _quant_parts(cache)
    if parts is not None:
        for suffix, a in parts.items():
            a[:, :, idx, :] = mx.array(pages_of(tensor_name(j) + suffix))
        return list(parts.values())
    if _is_host(cache):
        cache.host[:, :, slots, :] = pages_of(tensor_name(j))  # through the view: the numba kernel reads it
        return []
    if _is_portable(cache):
        cache.pool[:, :, idx, :] = to_device(pages_of(tensor_name(j)), cache.pool.dtype)
        return [cache.pool]
    kernel = _kernel_parts(cache)
    for suffix, pair in kernel.items():
        _scatter_pair(pair, idx, pages_of(tensor_name(j) + suffix))
    return [a for pair in kernel.values() for a in pair]
