"""Recurrent states (conv / SSM / gated delta) kept by block id, and each step's read/write plan.

The state group's table entries are ids from the one shared block pool; the runner's one block table
(block_table.py) holds them with every other group's. Every block id owns one
state slot per recurrent layer (a pool `[num_blocks, *shape]` per state array), so a block id maps to
state memory directly and the budget counts those bytes in every block (kvcache/specs.RecurrentState).
After `t` computed tokens a request's state lives in table entry `(t - 1) // block_size`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx

if TYPE_CHECKING:
    from metalserve.executor.block_table import BlockTables
    from metalserve.executor.step_inputs import StepInputs


@dataclass(frozen=True)
class StateSlot:
    """One array of a layer's state (mlx-lm's ArraysCache entry `index`), per request."""

    index: int
    shape: tuple[int, ...]
    dtype: mx.Dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.size
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class StateLayout:
    """Every recurrent layer's slots, in state-layer order; `cache_size`: ArraysCache entries per layer."""

    layers: tuple[tuple[StateSlot, ...], ...]
    cache_size: int

    @property
    def slot_bytes(self) -> int:
        """One request's state over every recurrent layer: what each block id's slot holds."""
        return sum(s.nbytes for layer in self.layers for s in layer)


class StatePool:
    """The state arrays of every recurrent layer, indexed by block id."""

    def __init__(self, layout: StateLayout, num_blocks: int) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.arrays: list[dict[int, mx.array]] = [
            {s.index: mx.zeros((num_blocks, *s.shape), s.dtype) for s in layer} for layer in layout.layers
        ]
        mx.eval(self.all_arrays())

    def all_arrays(self) -> list[mx.array]:
        return [a for layer in self.arrays for a in layer.values()]

    def grow(self, num_blocks: int) -> None:
        more = num_blocks - self.num_blocks
        for layer, slots in zip(self.arrays, self.layout.layers, strict=True):
            for s in slots:
                layer[s.index] = mx.concatenate([layer[s.index], mx.zeros((more, *s.shape), s.dtype)])
        self.num_blocks = num_blocks
        mx.eval(self.all_arrays())

    def truncate(self, num_blocks: int) -> None:
        """Keep the first `num_blocks` slots, in buffers of that size (a pool cut back at idle)."""
        for layer in self.arrays:
            for i, a in layer.items():
                layer[i] = mx.contiguous(a[:num_blocks])
        self.num_blocks = num_blocks
        mx.eval(self.all_arrays())

    def read(self, layer: int, block_ids: mx.array) -> dict[int, mx.array]:
        return {i: a[block_ids] for i, a in self.arrays[layer].items()}

    def write(self, layer: int, block_ids: mx.array, values: dict[int, mx.array]) -> None:
        arrays = self.arrays[layer]
        for i, v in values.items():
            arrays[i][block_ids] = v.astype(arrays[i].dtype)


@dataclass(frozen=True)
class StateRun:
    """Packed rows [start, stop) of one or more requests that run their recurrence in one call:
    one prefill segment, or a batch of single-token rows (one row per request)."""

    start: int
    stop: int
    batched: bool
    read_ids: mx.array | None  # [B] block ids holding the states to resume from; None: fresh (zeros)
    write_ids: mx.array  # [B] block ids the new states go to


@dataclass(frozen=True)
class StateStep:
    pool: StatePool
    runs: tuple[StateRun, ...]


class RecurrentStates:
    """The runner's side of the recurrent-state group: the state pool, and each request's entries read
    from that group's tables in the runner's one block table."""

    def __init__(self, layout: StateLayout, tables: BlockTables, num_blocks: int) -> None:
        if tables.state_group is None:
            raise ValueError("recurrent states for a KV spec without a recurrent-state group")
        self.group: int = tables.state_group
        self.tables, self.block_size = tables, tables.block_size
        self.pool = StatePool(layout, num_blocks)

    def _entry(self, rid: str, num_tokens: int) -> int:
        table, k = self.tables[rid].ids[self.group], (num_tokens - 1) // self.block_size
        if k >= len(table):
            raise ValueError(f"request {rid}: its state table has {len(table)} entries, entry {k} needed")
        return table[k]

    def plan(self, step: StepInputs) -> StateStep:
        """Single-token rows that resume a state batch together (neighbours in the packed order);
        every other request runs its own segment."""
        runs: list[StateRun] = []
        batch: list[tuple[int, int, int]] = []  # (row, read id, write id)

        def flush() -> None:
            if batch:
                rows = [b[0] for b in batch]
                runs.append(
                    StateRun(
                        rows[0], rows[-1] + 1, True, mx.array([b[1] for b in batch]), mx.array([b[2] for b in batch])
                    )
                )
                batch.clear()

        for i, rid in enumerate(step.request_ids):
            start, stop = int(step.cu_seqlens_q[i]), int(step.cu_seqlens_q[i + 1])
            computed = int(step.seq_lens[i]) - (stop - start)
            write = self._entry(rid, int(step.seq_lens[i]))
            if stop - start == 1 and computed > 0:  # a decode row: batch it with its neighbours
                if batch and batch[-1][0] != start - 1:
                    flush()
                batch.append((start, self._entry(rid, computed), write))
                continue
            flush()
            read = mx.array([self._entry(rid, computed)]) if computed > 0 else None
            runs.append(StateRun(start, stop, False, read, mx.array([write])))
        flush()
        return StateStep(self.pool, tuple(runs))
