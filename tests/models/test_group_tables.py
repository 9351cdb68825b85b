"""The runner's tables of layer groups 1.. and a step seen through one of them."""

from __future__ import annotations

import numpy as np
import pytest

from metalserve.executor.group_tables import GroupTables, group_step
from metalserve.executor.input_batch import CachedRequestState
from metalserve.executor.runner import ModelRunner
from metalserve.executor.step_inputs import pack_step
from metalserve.sampling_params import SamplingParams
from metalserve.scheduler.output import NewRequestData, SchedulerOutput
from tests.models import golden
from tests.models.archs import build


def test_a_step_through_another_groups_tables_writes_to_its_blocks() -> None:
    params = SamplingParams(temperature=0, max_tokens=1)
    states = {
        "a": CachedRequestState("a", list(range(20)), 20, params, [1, 2], 16),  # 4 new tokens at 16..19
        "b": CachedRequestState("b", [5], 1, params, [3], 0),
    }
    step = pack_step(states, {"a": 4, "b": 1}, 16)
    tables = GroupTables([[7, 9]])
    tables.add([[]])
    other = GroupTables([[4]])
    seen = group_step(step, [other.array(0), tables.array(0)], 16)  # packed order: b (decode) first
    assert step.request_ids == ["b", "a"]
    assert seen.slot_mapping.tolist() == [4 * 16, 9 * 16, 9 * 16 + 1, 9 * 16 + 2, 9 * 16 + 3]
    assert [r.tolist() for r in seen.block_rows] == [[4], [7, 9]]
    np.testing.assert_array_equal(seen.positions, step.positions)
    with pytest.raises(ValueError, match="2 group tables appended to a request with 1"):
        tables.add([[1], [2]])
    with pytest.raises(ValueError, match="too short"):
        group_step(step, [other.array(0), np.array([7])], 16)


def test_the_runner_refuses_tables_for_another_number_of_groups() -> None:
    core = golden.engine(build("gemma3_text"))  # two groups
    runner: ModelRunner = core.runner
    params = SamplingParams(temperature=0, max_tokens=1)
    new = NewRequestData("x", [1, 2, 3], 3, params, ([1],), 0)  # no table for the sliding group
    with pytest.raises(ValueError, match="1 block tables for a model of 2 layer groups"):
        runner.execute_model(SchedulerOutput([new], [], {"x": 3}, 3))
