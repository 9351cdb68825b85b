"""The scheduler over layer groups: per-group ids to the runner and block-aligned prefill chunks."""

from __future__ import annotations

import pytest

from metalserve.config import ConfigError, EngineConfig
from metalserve.kvcache.specs import FullAttention, LayerGroupSpec, RecurrentState, SlidingWindow
from metalserve.scheduler.output import ModelRunnerOutput
from metalserve.scheduler.scheduler import Scheduler
from tests.scheduler.sched_helpers import make_request


def scheduler(groups: list[LayerGroupSpec] | None, budget: int = 20) -> Scheduler:
    cfg = EngineConfig(block_size=8, max_num_batched_tokens=budget, max_num_seqs=4)
    return Scheduler(cfg, 40, 128, kv_groups=groups)


def test_state_groups_cut_prefill_chunks_at_block_boundaries() -> None:
    s = scheduler([FullAttention(), RecurrentState()])
    s.add_request(make_request("a", 30))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 16}  # 20 cut to 16: the state of 2 blocks is a snapshot
    (new,) = out.scheduled_new_reqs
    assert new.block_ids == ([1, 2], [0, 3])
    s.update_from_output(out, ModelRunnerOutput({}))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 14}  # the last chunk ends where the prompt does
    (cached,) = out.scheduled_cached_reqs
    assert cached.new_block_ids == ([4, 5], [0, 6])


def test_full_and_window_groups_keep_chunks_whole() -> None:
    for groups in (None, [FullAttention(), SlidingWindow(8)]):
        s = scheduler(groups)
        s.add_request(make_request("a", 30))
        out = s.schedule()
        assert out.num_scheduled_tokens == {"a": 20}
        (new,) = out.scheduled_new_reqs
        assert new.block_ids == (([1, 2, 3],) if groups is None else ([1, 2, 3], [4, 5, 6]))


def test_window_blocks_freed_by_decode_are_reported_only_as_new_ids() -> None:
    s = scheduler([FullAttention(), SlidingWindow(4)], budget=64)
    s.add_request(make_request("a", 16, max_tokens=10))
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput({"a": [7]}))
    out = s.schedule()  # token 16 starts a block in both groups; block 3 (0..7) fell out of the window
    (cached,) = out.scheduled_cached_reqs
    assert cached.new_block_ids == ([5], [6])
    assert s.kv.get_block_ids("a") == ([1, 2, 5], [0, 4, 6])
    assert s.kv.num_free_blocks == 39 - 3 - 2


def test_a_pool_too_small_for_one_request_in_every_group_is_a_config_error() -> None:
    cfg = EngineConfig(block_size=8)
    Scheduler(cfg, 16 + 1, 128)  # one group: 16 blocks and the null block
    groups: list[LayerGroupSpec] = [FullAttention(), SlidingWindow(8)]
    Scheduler(cfg, 16 + 16 + 1, 128, kv_groups=groups)
    with pytest.raises(ConfigError, match="33 blocks needed"):
        Scheduler(cfg, 32, 128, kv_groups=groups)
