"""Recurrent-state snapshots out of and into the state pool, and through the disk connector's worker half
with a real store: exact round trips (bfloat16 included), and a snapshot of another layout is a miss."""

from __future__ import annotations

import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from metalserve.executor.attention.base import LayerCacheSpec
from metalserve.executor.attention.mlx import MlxAttention
from metalserve.executor.block_table import BlockTables
from metalserve.executor.connector.disk_worker import DiskConnectorWorker
from metalserve.executor.connector.states import read_states, state_dtype_tag, state_shapes, write_states
from metalserve.executor.state_cache import RecurrentStates, StateLayout, StatePool, StateSlot
from metalserve.kvcache.connector.base import BlockTransfer, ConnectorMetadata
from metalserve.kvcache.connector.disk_store import DiskStore
from metalserve.kvcache.specs import FullAttention, RecurrentState

BS = 8
# Two recurrent layers: a conv state (bfloat16) and a recurrent state (float32) each, as gated-delta layers.
LAYOUT = StateLayout(
    layers=tuple((StateSlot(0, (3, 12), mx.bfloat16), StateSlot(1, (2, 4, 4), mx.float32)) for _ in range(2)),
    cache_size=2,
)
TABLES = BlockTables((FullAttention(), RecurrentState()), BS)  # the state group is group 1


def filled(layout: StateLayout, seed: int, num_blocks: int = 6) -> StatePool:
    pool = StatePool(layout, num_blocks)
    mx.random.seed(seed)
    for layer in pool.arrays:
        for i, a in layer.items():
            layer[i] = mx.random.normal(a.shape).astype(a.dtype)
    mx.eval(pool.all_arrays())
    return pool


def slot(pool: StatePool, layer: int, index: int, block: int) -> np.ndarray:
    a = pool.arrays[layer][index][block]
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)


def test_snapshots_round_trip_between_pools_bit_for_bit() -> None:
    src, dst = filled(LAYOUT, 0), filled(LAYOUT, 1)
    host = read_states(src, [4, 2])
    assert {k: v.shape for k, v in host[0].items()} == state_shapes(LAYOUT)
    assert host[0]["state.1.0"].dtype == np.uint16  # bfloat16 travels as its bits
    write_states(dst, [1, 5], host)
    for layer in range(2):
        for index in range(2):
            assert np.array_equal(slot(dst, layer, index, 1), slot(src, layer, index, 4))
            assert np.array_equal(slot(dst, layer, index, 5), slot(src, layer, index, 2))
            assert np.array_equal(slot(dst, layer, index, 3), slot(filled(LAYOUT, 1), layer, index, 3))  # untouched
    assert state_dtype_tag(LAYOUT) == "state:bfloat16,float32,bfloat16,float32"


def kv_pools() -> list[object]:
    cache = MlxAttention().allocate(LayerCacheSpec.dense(2, 16, mx.float32, BS, 6))
    cache.pool = mx.random.normal(cache.pool.shape)
    mx.eval(cache.arrays())
    return [cache]


def wait_loaded(worker: DiskConnectorWorker, caches: list[object], rid: str) -> int:
    for _ in range(1000):
        worker.start_load_kv(None, caches)
        out = worker.get_finished()
        if out is not None:
            return out.finished_loads[rid]
        time.sleep(0.01)  # the reader threads are still at it
    raise AssertionError("the load never finished")


def test_the_worker_saves_and_loads_a_state_group_transfer_as_a_snapshot(tmp_path: Path) -> None:
    states = RecurrentStates(LAYOUT, TABLES, num_blocks=6)
    states.pool = filled(LAYOUT, 2)
    caches = kv_pools()
    worker = DiskConnectorWorker(DiskStore(str(tmp_path), 1 << 30), BS, states)
    saves = [BlockTransfer(3, "a" * 64, 0), BlockTransfer(4, "b" * 64, 1)]  # KV pages of block 3, snapshot in 4
    worker.save_kv(ConnectorMetadata(saves=saves), caches)
    assert worker.wait_for_save(30)
    assert len(list(tmp_path.glob("*.safetensors"))) == 2
    want = {(j, i): slot(states.pool, j, i, 4) for j in range(2) for i in range(2)}
    states.pool = filled(LAYOUT, 3)  # other contents everywhere
    loads = [BlockTransfer(1, "a" * 64, 0), BlockTransfer(2, "b" * 64, 1)]
    worker.start_load_kv(ConnectorMetadata(loads={"r": loads}), caches)
    assert wait_loaded(worker, caches, "r") == 2
    for (j, i), value in want.items():
        assert np.array_equal(slot(states.pool, j, i, 2), value)

    # A worker whose state layout differs (another model's states under the same key) reads a miss.
    other = StateLayout(layers=LAYOUT.layers[:1], cache_size=2)
    states2 = RecurrentStates(other, TABLES, num_blocks=6)
    worker2 = DiskConnectorWorker(worker.store, BS, states2)
    worker2.start_load_kv(ConnectorMetadata(loads={"r": loads}), caches)
    assert wait_loaded(worker2, caches, "r") == 1  # the KV block arrived, the snapshot did not
    worker2.close()
    worker.close()
