"""The Metal backend's quantized pools (--kv-cache-dtype int8/q4) on the disk tier: its slot-major codes,
scales and q4 biases come back byte for byte, through the worker half and the store too, and a block
means the same to the Metal backend and to MLX ops (one host layout, one format)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from metalserve.executor.attention.base import AttentionCall, AttentionOptions, LayerCacheSpec
from metalserve.executor.attention.kv_quant import QuantPool
from metalserve.executor.attention.metal import KernelAttention, LayerKV, _dequantized
from metalserve.executor.attention.mlx import MlxAttention, PortableKV
from metalserve.executor.connector.disk_worker import DiskConnectorWorker
from metalserve.executor.connector.pages import dtype_tag, expected_shapes, read_blocks, supported, write_blocks
from metalserve.executor.step_inputs import StepInputs
from metalserve.kvcache.connector.base import BlockTransfer, ConnectorMetadata
from metalserve.kvcache.connector.disk_store import SUFFIX, DiskStore, decode_block

BS, HEADS, D = 8, 2, 64
STORAGES = ["int8", "q4"]
NAMES = ("k", "v", "k_scales", "v_scales", "k_biases", "v_biases")


def spec(storage: str, num_blocks: int) -> LayerCacheSpec:
    return LayerCacheSpec.dense(HEADS, D, mx.float32, BS, num_blocks, storage=storage)  # type: ignore[arg-type]


def unused_kernel(q: mx.array, *args: Any, **kwargs: Any) -> mx.array:
    return q  # the pools are what these tests look at, not the attention


def known(a: mx.array, rng: np.random.Generator) -> mx.array:
    """Distinct values of `a`'s dtype and shape: every code byte, every float16 scale and bias bit pattern."""
    if a.dtype in (mx.int8, mx.uint8):
        info = np.iinfo(np.int8 if a.dtype == mx.int8 else np.uint8)
        return mx.array(rng.integers(info.min, info.max + 1, a.shape).astype(info.dtype))
    return mx.array(rng.standard_normal(a.shape).astype(np.float16))


def metal_pools(storage: str, seed: int) -> list[LayerKV]:
    """Two pool tensors of 6 blocks, allocated and grown (4 + 2 blocks) as the runner does, filled with
    known values."""
    backend, rng = KernelAttention(unused_kernel), np.random.default_rng(seed)
    out = []
    for _ in range(2):
        cache = backend.extend(backend.allocate(spec(storage, 4)), spec(storage, 2))
        cache = cache.with_arrays([known(a, rng) for a in cache.arrays()])
        mx.eval(cache.arrays())
        out.append(cache)
    return out


def slots_of(cache: LayerKV, name: str, block: int) -> np.ndarray:
    """The raw bytes' array of one block's slots of one of the cache's arrays."""
    return np.array(getattr(cache, name)[block * BS : (block + 1) * BS])


def assert_blocks_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert got[name].tobytes() == want[name].tobytes(), name


@pytest.mark.parametrize("storage", STORAGES)
def test_the_metal_backends_quantized_blocks_round_trip_byte_for_byte(storage: str) -> None:
    src, dst = metal_pools(storage, 0), metal_pools(storage, 1)
    assert all(supported(c) for c in src) and dtype_tag(src) == ("int8" if storage == "int8" else "uint8")
    blocks = read_blocks(src, [2, 5], BS)
    width, groups = (D, 1) if storage == "int8" else (D // 2, D // src[0].page.group_for(D))  # type: ignore[union-attr]
    want = {"kv.0": (2, HEADS, BS, width), "kv.0.scales": (2, HEADS, BS, groups)}
    if storage == "q4":
        want["kv.0.biases"] = (2, HEADS, BS, groups)
    want |= {name.replace("kv.0", "kv.1"): shape for name, shape in want.items()}
    assert {k: v.shape for k, v in blocks[0].items()} == expected_shapes(src, BS) == want
    assert blocks[0]["kv.0.scales"].dtype == np.float16
    untouched = read_blocks(dst, [0, 2, 4, 5], BS)
    write_blocks(dst, [1, 3], blocks, BS)
    for got, want_block in zip(read_blocks(dst, [1, 3, 0, 2, 4, 5], BS), blocks + untouched, strict=True):
        assert_blocks_equal(got, want_block)
    # Straight from the pools: block 1 of the target holds block 2 of the source, in every array.
    for j in range(2):
        for name in NAMES:
            if getattr(src[j], name) is not None:
                for target, source in ((1, 2), (3, 5)):
                    a, b = slots_of(dst[j], name, target), slots_of(src[j], name, source)
                    assert a.tobytes() == b.tobytes(), (j, name)


def wait_loaded(worker: DiskConnectorWorker, caches: list[Any], rid: str) -> int:
    for _ in range(1000):
        worker.start_load_kv(None, caches)
        out = worker.get_finished()
        if out is not None:
            return out.finished_loads[rid]
        time.sleep(0.01)  # the reader threads are still at it
    raise AssertionError("the load never finished")


@pytest.mark.parametrize("storage", STORAGES)
def test_the_worker_saves_the_metal_backends_quantized_blocks_and_a_restart_loads_them(
    storage: str, tmp_path: Path
) -> None:
    src = metal_pools(storage, 2)
    worker = DiskConnectorWorker(DiskStore(str(tmp_path), 1 << 30), BS)
    keys = ["a" * 64, "b" * 64]
    worker.save_kv(ConnectorMetadata(saves=[BlockTransfer(4, keys[0]), BlockTransfer(1, keys[1])]), src)
    assert worker.wait_for_save(30)
    worker.close()
    files = sorted(tmp_path.glob("*" + SUFFIX))
    assert len(files) == 2
    tensors = decode_block(files[0].read_bytes(), files[0].name[:64])
    assert tensors is not None
    assert str(tensors["kv.0"].dtype) == ("int8" if storage == "int8" else "uint8")
    assert str(tensors["kv.1.scales"].dtype) == "float16" and ("kv.1.biases" in tensors) == (storage == "q4")

    # A restart: a new store rebuilds its index from the directory; fresh pools of other contents.
    dst = metal_pools(storage, 3)
    untouched = read_blocks(dst, [0, 1, 3, 4, 5], BS)
    restarted = DiskConnectorWorker(DiskStore(str(tmp_path), 1 << 30), BS)
    loads = [BlockTransfer(2, keys[0]), BlockTransfer(0, keys[1])]
    restarted.start_load_kv(ConnectorMetadata(loads={"r": loads}), dst)
    assert wait_loaded(restarted, dst, "r") == 2
    restarted.close()
    for j in range(2):
        for name in NAMES:
            if getattr(src[j], name) is not None:
                for target, source in ((2, 4), (0, 1)):
                    assert slots_of(dst[j], name, target).tobytes() == slots_of(src[j], name, source).tobytes()
    for got, want in zip(read_blocks(dst, [1, 3, 4, 5], BS), untouched[1:], strict=True):
        assert_blocks_equal(got, want)


def written_by(backend: Any, storage: str, kv: mx.array) -> Any:
    """A pool of 4 blocks whose every slot the backend's own forward wrote from `kv` `[2, slots, H, D]`."""
    cache = backend.allocate(spec(storage, 4))
    t = 4 * BS
    ramp = np.arange(t, dtype=np.int32)
    step = StepInputs(
        ["x"], ramp, ramp, ramp, np.array([0, t], np.int32), np.array([t], np.int32), [np.arange(4)], [], ramp[:0]
    )
    meta = backend.build_metadata(step, spec(storage, 4))
    backend.forward(AttentionCall(kv[0], kv[0], kv[1], mx.array(ramp), cache, meta, AttentionOptions(1.0)))
    mx.eval(cache.arrays())
    return cache


@pytest.mark.parametrize("storage", STORAGES)
def test_a_block_means_the_same_to_the_metal_backend_and_to_mlx_ops(storage: str) -> None:
    """The same K/V written by each backend's forward gives the same stored block, byte for byte, and a
    block of either loads into the other with the same dequantized values."""
    kv = mx.random.normal((2, 4 * BS, HEADS, D), key=mx.random.key(7))
    metal = written_by(KernelAttention(unused_kernel), storage, kv)
    portable = written_by(MlxAttention(), storage, kv)
    assert isinstance(metal, LayerKV) and isinstance(portable, PortableKV)
    from_metal, from_mlx = read_blocks([metal], [1, 3], BS), read_blocks([portable], [1, 3], BS)
    for a, b in zip(from_metal, from_mlx, strict=True):
        assert_blocks_equal(a, b)
    assert expected_shapes([metal], BS) == expected_shapes([portable], BS)
    assert dtype_tag([metal]) == dtype_tag([portable])

    # Metal's block 1 into MLX ops' block 0, MLX ops' block 3 into Metal's block 2: the dequantized
    # values arrive with the block.
    before = mlx_values(portable, 0), metal_values(metal, 2)
    write_blocks([portable], [0], from_metal[:1], BS)
    write_blocks([metal], [2], from_mlx[1:], BS)
    np.testing.assert_array_equal(mlx_values(portable, 0), metal_values(metal, 1))
    np.testing.assert_array_equal(metal_values(metal, 2), mlx_values(portable, 3))
    assert np.abs(mlx_values(portable, 0)).max() > 0
    assert not np.array_equal(before[0], mlx_values(portable, 0))
    assert not np.array_equal(before[1], metal_values(metal, 2))


def mlx_values(cache: PortableKV, block: int) -> np.ndarray:
    """Block `block` of an MLX-ops pool dequantized, `[2, H, BS, D]`."""
    assert isinstance(cache.pool, QuantPool)
    return np.array(cache.pool.take(mx.arange(block * BS, (block + 1) * BS)))


def metal_values(cache: LayerKV, block: int) -> np.ndarray:
    """Block `block` of a Metal pool dequantized as its MLX-ops fallback reads it, `[2, H, BS, D]`."""
    pools = _dequantized(cache, mx.float32)
    kv = mx.stack([pools.k, pools.v])[:, block * BS : (block + 1) * BS]
    return np.array(kv.transpose(0, 2, 1, 3))
