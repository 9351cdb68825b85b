"""The runner's one block table: every request's block ids in every layer group, indexed by the KV
spec's group index (after vLLM's MultiGroupBlockTable).

The scheduler sends every group's table whole for a new request and the appended ids for a running one
(`BlockIds`, one list per group of kvcache/specs.py's `KVCacheSpec.groups`). Attention groups read
their tables here for each step's slot mapping and block rows; the recurrent-state group (a hybrid
model's) reads the entries its states live in. Entries the scheduler freed (behind a sliding window)
stay here with their old ids, which the group's layers never read outside the window (the backends
mask by it), so the runner need not hear of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from metalserve.executor.step_inputs import StepInputs, table_slots
from metalserve.kvcache.specs import AttentionSpec, LayerGroupSpec, RecurrentState

# The group a step is packed through (pack_step reads a request's `block_array`, this group's table):
# group 0, the first attention group, whose table a draft model shares too.
PACKED_GROUP = 0


class RequestBlockTable:
    """One request's block ids in every layer group, each with an int64 array rebuilt only when ids
    were added (a step reads the arrays, most steps add nothing)."""

    __slots__ = ("_arrays", "ids")

    def __init__(self, tables: Sequence[Sequence[int]]) -> None:
        self.ids: list[list[int]] = [list(t) for t in tables]
        self._arrays: list[np.ndarray | None] = [None] * len(self.ids)

    def append(self, new: Sequence[Sequence[int]]) -> None:
        """Each group's appended ids (one list per group; empty lists for groups that grew by none)."""
        if len(new) != len(self.ids):
            raise ValueError(f"{len(new)} group tables appended to a request with {len(self.ids)}")
        for group, ids in enumerate(new):
            if ids:
                self.ids[group].extend(ids)
                self._arrays[group] = None

    def array(self, group: int) -> np.ndarray:
        arr = self._arrays[group]
        if arr is None:
            arr = self._arrays[group] = np.asarray(self.ids[group], dtype=np.int64)
        return arr


class BlockTables:
    """Every request's `RequestBlockTable`, with what each group of the spec is."""

    def __init__(self, groups: Sequence[LayerGroupSpec], block_size: int) -> None:
        self.block_size = block_size
        self.num_groups = len(groups)
        self.attention_groups = tuple(i for i, g in enumerate(groups) if isinstance(g, AttentionSpec))
        if self.attention_groups != tuple(range(len(self.attention_groups))) or not self.attention_groups:
            # Layers index the forward context's groups by their spec group (models/kv_layout.py).
            raise ValueError("a KV spec's attention groups come first, from group 0")
        states = [i for i, g in enumerate(groups) if isinstance(g, RecurrentState)]
        if len(states) > 1:
            raise ValueError(f"one recurrent-state group per model, got {len(states)}")
        # The recurrent-state group's index; None for a model without recurrent layers.
        self.state_group: int | None = states[0] if states else None
        self._requests: dict[str, RequestBlockTable] = {}

    def add_request(self, request_id: str, block_ids: Sequence[Sequence[int]]) -> RequestBlockTable:
        if len(block_ids) != self.num_groups:
            raise ValueError(
                f"request {request_id}: {len(block_ids)} block tables for a model of {self.num_groups} layer groups"
            )
        table = self._requests[request_id] = RequestBlockTable(block_ids)
        return table

    def append(self, request_id: str, new_block_ids: Sequence[Sequence[int]]) -> None:
        self._requests[request_id].append(new_block_ids)

    def remove(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def __getitem__(self, request_id: str) -> RequestBlockTable:
        return self._requests[request_id]

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def group_step(self, step: StepInputs, group: int) -> StepInputs:
        """`step` seen through `group`'s tables: its slot mapping and block rows (so its padded table);
        positions, lengths and sampling rows are the step's own. The packed group's view is the step."""
        if group == PACKED_GROUP:
            return step
        tables = [self._requests[rid].array(group) for rid in step.request_ids]
        for rid, table, length in zip(step.request_ids, tables, step.seq_lens, strict=True):
            if -(-int(length) // self.block_size) > len(table):
                raise ValueError(f"request {rid}: a group table of {len(table)} blocks is too short")
        slots = table_slots(tables, step.positions, step.cu_seqlens_q, self.block_size)
        return replace(step, slot_mapping=slots, block_rows=tables)
