"""The runner's one block table: every group's tables by the spec's group index, and a step seen
through each group."""

from __future__ import annotations

import numpy as np
import pytest

from metalserve.executor.block_table import BlockTables
from metalserve.executor.input_batch import CachedRequestState
from metalserve.executor.runner import ModelRunner
from metalserve.executor.step_inputs import pack_step
from metalserve.kvcache.specs import FullAttention, RecurrentState, SlidingWindow
from metalserve.sampling_params import SamplingParams
from metalserve.scheduler.output import NewRequestData, SchedulerOutput
from tests.models import golden
from tests.models.archs import build

GROUPS = (FullAttention(), SlidingWindow(window=8), RecurrentState())


def test_a_step_through_each_group_writes_to_that_group_s_blocks() -> None:
    params = SamplingParams(temperature=0, max_tokens=1)
    tables = BlockTables(GROUPS, 16)
    assert (tables.attention_groups, tables.state_group) == ((0, 1), 2)
    states = {
        "a": CachedRequestState("a", list(range(20)), 20, params, tables.add_request("a", ([1, 2], [7], [5])), 16),
        "b": CachedRequestState("b", [5], 1, params, tables.add_request("b", ([3], [4], [6])), 0),
    }
    tables.append("a", ([], [9], []))
    step = pack_step(states, {"a": 4, "b": 1}, 16)  # 4 new tokens of a at 16..19; b decodes first
    assert step.request_ids == ["b", "a"]
    assert tables.group_step(step, 0) is step  # the step is packed through group 0's tables
    assert step.slot_mapping.tolist() == [3 * 16, 2 * 16, 2 * 16 + 1, 2 * 16 + 2, 2 * 16 + 3]
    seen = tables.group_step(step, 1)
    assert seen.slot_mapping.tolist() == [4 * 16, 9 * 16, 9 * 16 + 1, 9 * 16 + 2, 9 * 16 + 3]
    assert seen.padded_block_tables().tolist() == [[4, 0], [7, 9]]
    np.testing.assert_array_equal(seen.positions, step.positions)
    assert tables["a"].ids[2] == [5] and states["a"].block_ids == [1, 2]
    with pytest.raises(ValueError, match="2 group tables appended to a request with 3"):
        tables.append("a", ([1], [2]))
    tables.append("a", ([], [], []))
    tables["a"].ids[1][:] = [7]  # a table shorter than the step needs
    tables["a"]._arrays[1] = None
    with pytest.raises(ValueError, match="too short"):
        tables.group_step(step, 1)
    tables.remove("b")
    assert "b" not in tables and "a" in tables


def test_a_spec_whose_attention_groups_do_not_come_first_is_refused() -> None:
    with pytest.raises(ValueError, match="attention groups come first"):
        BlockTables((RecurrentState(), FullAttention()), 16)
    with pytest.raises(ValueError, match="one recurrent-state group"):
        BlockTables((FullAttention(), RecurrentState(), RecurrentState()), 16)
    assert BlockTables((FullAttention(),), 16).state_group is None


def test_the_runner_refuses_tables_for_another_number_of_groups() -> None:
    core = golden.engine(build("gemma3_text"))  # two groups
    runner: ModelRunner = core.runner
    params = SamplingParams(temperature=0, max_tokens=1)
    new = NewRequestData("x", [1, 2, 3], 3, params, ([1],), 0)  # no table for the sliding group
    with pytest.raises(ValueError, match="1 block tables for a model of 2 layer groups"):
        runner.execute_model(SchedulerOutput([new], [], {"x": 3}, 3))
