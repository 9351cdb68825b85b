"""The runner's state plan: which entry each request resumes from and writes, and which rows batch."""

from __future__ import annotations

import mlx.core as mx
import pytest

from metalserve.executor.input_batch import CachedRequestState
from metalserve.executor.state_cache import RecurrentStates, StateLayout, StateSlot
from metalserve.executor.step_inputs import pack_step
from metalserve.sampling_params import SamplingParams
from metalserve.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput

BS = 4
LAYOUT = StateLayout(((StateSlot(0, (2, 3), mx.float32), StateSlot(1, (5,), mx.float32)),), 2)
PARAMS = SamplingParams(temperature=0)


def new(rid: str, tokens: int, computed: int, groups: tuple[list[int], ...]) -> NewRequestData:
    return NewRequestData(rid, list(range(tokens)), tokens, PARAMS, ([1] * 8, *groups), computed)


def states_for(*reqs: NewRequestData) -> RecurrentStates:
    states = RecurrentStates(LAYOUT, 1, BS, 32)
    states.update(SchedulerOutput(list(reqs), [], {}, 0))
    return states


def requests(*reqs: NewRequestData) -> dict[str, CachedRequestState]:
    return {
        r.request_id: CachedRequestState(
            r.request_id, r.token_ids, r.num_prompt_tokens, PARAMS, r.block_ids[0], r.num_computed_tokens
        )
        for r in reqs
    }


def test_decode_rows_batch_and_prefill_segments_resume_from_their_entries() -> None:
    # d1, d2 decode mid-block (read = write entry); p resumes a chunk from entry 1; f starts fresh.
    d1 = new("d1", 6, 5, ([0, 7],))
    d2 = new("d2", 11, 10, ([0, 0, 9],))
    p = new("p", 12, 8, ([0, 11, 12],))
    f = new("f", 6, 0, ([0, 13],))
    step = pack_step(requests(d1, d2, p, f), {"d1": 1, "d2": 1, "p": 4, "f": 6}, BS)
    plan = states_for(d1, d2, p, f).plan(step)
    batched = plan.runs[0]
    assert (batched.start, batched.stop, batched.batched, len(plan.runs)) == (0, 2, True, 3)
    assert batched.read_ids.tolist() == [7, 9] and batched.write_ids.tolist() == [7, 9]  # type: ignore[union-attr]

    def run_of(rid: str):  # type: ignore[no-untyped-def]
        start = int(step.cu_seqlens_q[step.request_ids.index(rid)])
        return next(r for r in plan.runs if r.start == start)

    assert run_of("p").read_ids.tolist() == [11] and run_of("p").write_ids.tolist() == [12]
    assert run_of("f").read_ids is None and run_of("f").write_ids.tolist() == [13]


def test_tables_follow_the_scheduler_and_a_preempted_request_starts_over() -> None:
    states = states_for(new("a", 9, 0, ([0, 3],)))
    states.update(SchedulerOutput([], [CachedRequestData("a", ([], [0, 5]), 8)], {}, 0))
    assert states.tables["a"] == [0, 3, 0, 5]
    states.update(SchedulerOutput([], [], {}, 0, preempted_req_ids={"a"}))
    assert "a" not in states.tables
    with pytest.raises(ValueError, match="no table for the recurrent-state group 1"):
        states.update(SchedulerOutput([new("b", 4, 0, ())], [], {}, 0))


def test_the_pool_grows_keeping_states_and_writes_by_block_id() -> None:
    states = RecurrentStates(LAYOUT, 1, BS, 4)
    states.pool.write(0, mx.array([3]), {0: mx.ones((1, 2, 3)), 1: mx.full((1, 5), 2.0)})
    states.pool.grow(10)
    got = states.pool.read(0, mx.array([3, 9]))
    assert got[0].shape == (2, 2, 3) and got[0][0].sum().item() == 6 and got[0][1].sum().item() == 0
    assert got[1][0].tolist() == [2.0] * 5
