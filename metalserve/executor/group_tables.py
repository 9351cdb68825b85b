"""The block tables of layer groups 1.. per request, and a step seen through one group's tables.

Group 0's table is `CachedRequestState.block_ids` (what pack_step reads). The scheduler sends every
group's table whole for a new request and the appended ids for a running one; entries it
freed (behind a sliding window) stay here with their old ids, which the group's layers never read
outside the window (the backends mask by it), so the runner need not hear of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from metalserve.executor.step_inputs import StepInputs


class GroupTables:
    """One request's tables of groups 1.., with int64 arrays rebuilt only when ids were added."""

    def __init__(self, tables: Sequence[Sequence[int]]) -> None:
        self.tables = [list(t) for t in tables]
        self._arrays: list[np.ndarray | None] = [None] * len(self.tables)

    def add(self, new: Sequence[Sequence[int]]) -> None:
        if new and len(new) != len(self.tables):
            raise ValueError(f"{len(new)} group tables appended to a request with {len(self.tables)}")
        for i, ids in enumerate(new):
            if ids:
                self.tables[i].extend(ids)
                self._arrays[i] = None

    def array(self, i: int) -> np.ndarray:
        """Group `i + 1`'s table."""
        arr = self._arrays[i]
        if arr is None:
            arr = self._arrays[i] = np.asarray(self.tables[i], dtype=np.int64)
        return arr


def group_step(step: StepInputs, tables: Sequence[np.ndarray], block_size: int) -> StepInputs:
    """`step` with another group's tables (one per request, in `step.request_ids` order): its block rows
    and the slots its K/V goes to; positions, lengths and sampling rows are the step's own."""
    slots = np.empty_like(step.slot_mapping)
    cu = step.cu_seqlens_q
    for i, table in enumerate(tables):
        if -(-int(step.seq_lens[i]) // block_size) > len(table):
            raise ValueError(f"request {step.request_ids[i]}: a group table of {len(table)} blocks is too short")
        pos = step.positions[cu[i] : cu[i + 1]]
        slots[cu[i] : cu[i + 1]] = table[pos // block_size] * block_size + pos % block_size
    return replace(step, slot_mapping=slots, block_rows=list(tables))
