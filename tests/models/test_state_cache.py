"""The runner's state plan: which entry each request resumes from and writes, and which rows batch."""

from __future__ import annotations

import mlx.core as mx
import pytest

from metalserve.executor.block_table import BlockTables
from metalserve.executor.input_batch import CachedRequestState
from metalserve.executor.state_cache import RecurrentStates, StateLayout, StateSlot
from metalserve.executor.step_inputs import pack_step
from metalserve.kvcache.specs import FullAttention, RecurrentState
from metalserve.sampling_params import SamplingParams
from metalserve.scheduler.output import NewRequestData

BS = 4
LAYOUT = StateLayout(((StateSlot(0, (2, 3), mx.float32), StateSlot(1, (5,), mx.float32)),), 2)
PARAMS = SamplingParams(temperature=0)


def new(rid: str, tokens: int, computed: int, groups: tuple[list[int], ...]) -> NewRequestData:
    return NewRequestData(rid, list(range(tokens)), tokens, PARAMS, ([1] * 8, *groups), computed)


GROUPS = (FullAttention(), RecurrentState())  # group 1 holds the states


def tables_for(*reqs: NewRequestData) -> BlockTables:
    tables = BlockTables(GROUPS, BS)
    for r in reqs:
        tables.add_request(r.request_id, r.block_ids)
    return tables


def requests(tables: BlockTables, *reqs: NewRequestData) -> dict[str, CachedRequestState]:
    return {
        r.request_id: CachedRequestState(
            r.request_id, r.token_ids, r.num_prompt_tokens, PARAMS, tables[r.request_id], r.num_computed_tokens
        )
        for r in reqs
    }


def test_decode_rows_batch_and_prefill_segments_resume_from_their_entries() -> None:
    # d1, d2 decode mid-block (read = write entry); p resumes a chunk from entry 1; f starts fresh.
    d1 = new("d1", 6, 5, ([0, 7],))
    d2 = new("d2", 11, 10, ([0, 0, 9],))
    p = new("p", 12, 8, ([0, 11, 12],))
    f = new("f", 6, 0, ([0, 13],))
    tables = tables_for(d1, d2, p, f)
    step = pack_step(requests(tables, d1, d2, p, f), {"d1": 1, "d2": 1, "p": 4, "f": 6}, BS)
    plan = RecurrentStates(LAYOUT, tables, 32).plan(step)
    batched = plan.runs[0]
    assert (batched.start, batched.stop, batched.batched, len(plan.runs)) == (0, 2, True, 3)
    assert batched.read_ids.tolist() == [7, 9] and batched.write_ids.tolist() == [7, 9]  # type: ignore[union-attr]

    def run_of(rid: str):  # type: ignore[no-untyped-def]
        start = int(step.cu_seqlens_q[step.request_ids.index(rid)])
        return next(r for r in plan.runs if r.start == start)

    assert run_of("p").read_ids.tolist() == [11] and run_of("p").write_ids.tolist() == [12]
    assert run_of("f").read_ids is None and run_of("f").write_ids.tolist() == [13]


def test_states_read_their_entries_from_the_one_block_table_as_it_grows() -> None:
    tables = tables_for(new("a", 9, 0, ([0, 3],)))
    states = RecurrentStates(LAYOUT, tables, 32)
    assert (states.group, states._entry("a", 8)) == (1, 3)
    tables.append("a", ([], [0, 5]))
    assert tables["a"].ids == [[1] * 8, [0, 3, 0, 5]] and states._entry("a", 13) == 5
    with pytest.raises(ValueError, match="its state table has 4 entries, entry 4 needed"):
        states._entry("a", 17)
    with pytest.raises(ValueError, match="1 block tables for a model of 2 layer groups"):
        tables.add_request("b", ([1],))
    with pytest.raises(ValueError, match="without a recurrent-state group"):
        RecurrentStates(LAYOUT, BlockTables(GROUPS[:1], BS), 32)


def test_the_pool_grows_keeping_states_and_writes_by_block_id() -> None:
    states = RecurrentStates(LAYOUT, BlockTables(GROUPS, BS), 4)
    states.pool.write(0, mx.array([3]), {0: mx.ones((1, 2, 3)), 1: mx.full((1, 5), 2.0)})
    states.pool.grow(10)
    got = states.pool.read(0, mx.array([3, 9]))
    assert got[0].shape == (2, 2, 3) and got[0][0].sum().item() == 6 and got[0][1].sum().item() == 0
    assert got[1][0].tolist() == [2.0] * 5
