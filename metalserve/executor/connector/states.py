"""A recurrent-state snapshot out of and into the state pool, on the host.

A block id of the recurrent-state group owns one slot per recurrent layer in the runner's StatePool
(executor/state_cache.py); the state in it after a block's last token is that block's snapshot. On the
host a snapshot is one array per (state layer, ArraysCache entry), named `state.L.I`, in the slot's own
shape; bfloat16 travels as its bits (uint16), as KV pages do (pages.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from metalserve.executor.connector.pages import HostBlock, to_device, to_host
from metalserve.executor.state_cache import StateLayout, StatePool


def state_name(layer: int, index: int) -> str:
    return f"state.{layer}.{index}"


def state_shapes(layout: StateLayout) -> dict[str, tuple[int, ...]]:
    """The host snapshot's tensors and shapes: a stored snapshot must match them."""
    return {state_name(j, s.index): s.shape for j, layer in enumerate(layout.layers) for s in layer}


def state_dtype_tag(layout: StateLayout) -> str:
    """Every slot's dtype in order, stored with each snapshot (one of other dtypes is a miss)."""
    dtypes = (str(s.dtype).removeprefix("mlx.core.") for layer in layout.layers for s in layer)
    return "state:" + ",".join(dtypes)


def read_states(pool: StatePool, block_ids: Sequence[int]) -> list[HostBlock]:
    """Copies of the snapshots at `block_ids`, one dict per block (on the thread that owns the pool,
    after the step's arrays are evaluated)."""
    if not block_ids:
        return []
    idx = mx.array(list(block_ids))
    out: list[HostBlock] = [{} for _ in block_ids]
    for j, arrays in enumerate(pool.arrays):
        for index, a in arrays.items():
            rows = to_host(mx.take(a, idx, axis=0))
            for b in range(len(block_ids)):
                out[b][state_name(j, index)] = np.ascontiguousarray(rows[b])
    return out


def write_states(pool: StatePool, block_ids: Sequence[int], blocks: Sequence[HostBlock]) -> None:
    """Put host snapshots (as `read_states` made them) into the pool's slots at `block_ids`."""
    if not block_ids:
        return
    idx = mx.array(list(block_ids))
    for j, arrays in enumerate(pool.arrays):
        for index, a in arrays.items():
            rows = np.stack([b[state_name(j, index)] for b in blocks])
            arrays[index][idx] = to_device(rows, a.dtype)
    mx.eval(pool.all_arrays())
