"""A block's pages out of and into every backend's pools: one host layout, exact round trips."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from metalserve.executor.attention.base import LayerCacheSpec, dtype_name
from metalserve.executor.attention.metal import KernelAttention, LayerKV
from metalserve.executor.attention.mlx import MlxAttention, PortableKV
from metalserve.executor.connector.pages import expected_shapes, read_blocks, supported, write_blocks
from metalserve.kvcache.specs import MLALatent, PageDtype
from metalserve.platform import current_platform

BS = 8


def pools(kind: str, dtype: mx.Dtype, seed: int, value_dim: int | None = None) -> list[Any]:
    """Two pool tensors of 6 blocks filled with distinct random values."""
    mx.random.seed(seed)
    if value_dim is None:
        spec = LayerCacheSpec.dense(2, 16, dtype, BS, 6)
    else:
        latent = MLALatent(
            num_kv_heads=1, head_dim=16, value_dim=value_dim, page=PageDtype(dtype_name(dtype), dtype.size)
        )
        spec = LayerCacheSpec(latent, BS, 6)
    out: list[Any] = []
    for _ in range(2):
        if kind == "kernel":
            cache = KernelAttention(lambda *a: None).allocate(spec)
            cache.k = mx.random.normal(cache.k.shape).astype(dtype)
            cache.v = mx.random.normal(cache.v.shape).astype(dtype)
        elif kind == "cpu":
            from metalserve.executor.attention.cpu import CpuAttention, HostKV

            cache = CpuAttention().allocate(spec)
            cache = HostKV.of(mx.random.normal(cache.pool.shape).astype(dtype))
        else:
            cache = MlxAttention().allocate(spec)
            cache.pool = mx.random.normal(cache.pool.shape).astype(dtype)
        mx.eval(cache.arrays())
        out.append(cache)
    return out


def cases() -> list[tuple[str, mx.Dtype]]:
    """Every pool kind in its dtypes (the CPU backend keeps float32 only, and needs numba)."""
    cases = [(kind, dtype) for kind in ("mlx", "kernel") for dtype in (mx.float32, mx.float16, mx.bfloat16)]
    return cases + ([("cpu", mx.float32)] if current_platform().numba else [])


@pytest.mark.parametrize(("kind", "dtype"), cases())
def test_blocks_round_trip_between_pools_of_one_kind(kind: str, dtype: mx.Dtype) -> None:
    src, dst = pools(kind, dtype, 0), pools(kind, dtype, 1)
    assert all(supported(c) for c in src)
    blocks = read_blocks(src, [2, 4], BS)
    assert (
        {k: v.shape for k, v in blocks[0].items()}
        == expected_shapes(src, BS)
        == {"kv.0": (2, 2, BS, 16), "kv.1": (2, 2, BS, 16)}
    )
    untouched = read_blocks(dst, [0, 2, 5], BS)
    write_blocks(dst, [1, 3], blocks, BS)
    again = read_blocks(dst, [1, 3, 0, 2, 5], BS)
    for got, want in zip(again, blocks + untouched, strict=True):
        assert all(np.array_equal(got[k], want[k]) for k in want)


def test_the_host_layout_is_the_same_for_every_backend() -> None:
    """Pages saved by one backend load into another (the same model on another --attention-backend)."""
    mlx_pools = pools("mlx", mx.float32, 3)
    blocks = read_blocks(mlx_pools, [1, 2], BS)
    kernel_pools = pools("kernel", mx.float32, 4)
    write_blocks(kernel_pools, [4, 5], blocks, BS)
    for got, want in zip(read_blocks(kernel_pools, [4, 5], BS), blocks, strict=True):
        assert all(np.array_equal(got[k], want[k]) for k in want)
    # The kernel pool's slot 4 * BS + 3, head 1 holds what the MLX pool had at slot 1 * BS + 3, head 1.
    k = np.array(kernel_pools[0].k[4 * BS + 3, 1])
    assert np.array_equal(k, np.array(mlx_pools[0].pool[0, 1, 1 * BS + 3]))
    assert isinstance(kernel_pools[0], LayerKV) and isinstance(mlx_pools[0], PortableKV)


def test_mla_latent_pages_have_one_plane() -> None:
    src, dst = pools("mlx", mx.float32, 5, value_dim=8), pools("mlx", mx.float32, 6, value_dim=8)
    blocks = read_blocks(src, [3], BS)
    assert blocks[0]["kv.0"].shape == (1, 1, BS, 16)
    write_blocks(dst, [2], blocks, BS)
    assert np.array_equal(read_blocks(dst, [2], BS)[0]["kv.1"], blocks[0]["kv.1"])
