"""The token budget: chunked prefill, the long-prefill threshold, max_num_seqs, output diffs."""

from __future__ import annotations

import pytest

from metalserve.config import ConfigError, EngineConfig
from metalserve.scheduler.scheduler import Scheduler
from tests.scheduler.sched_helpers import make_request, make_scheduler, step


def test_chunked_prefill_follows_the_budget_then_decodes() -> None:
    s = make_scheduler(max_num_batched_tokens=16)
    s.add_request(make_request("a", 40, max_tokens=2))
    chunks = []
    for _ in range(4):
        out, _ = step(s)
        chunks.append(out.num_scheduled_tokens["a"])
        assert out.total_num_scheduled_tokens <= 16
    assert chunks == [16, 16, 8, 1]  # the last chunk samples token 1; one decode samples token 2
    assert not s.has_unfinished_requests()


def test_running_first_then_waiting_with_remaining_budget() -> None:
    s = make_scheduler(max_num_batched_tokens=20)
    s.add_request(make_request("a", 10, max_tokens=8))
    step(s)
    s.add_request(make_request("b", 30))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 19}
    assert [r.request_id for r in out.scheduled_new_reqs] == ["b"]
    assert [r.request_id for r in out.scheduled_cached_reqs] == ["a"]


def test_long_prefill_threshold_lets_short_prompts_in() -> None:
    s = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=24)
    s.add_request(make_request("long", 200))
    s.add_request(make_request("short1", 10))
    s.add_request(make_request("short2", 12))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"long": 24, "short1": 10, "short2": 12}


def test_without_threshold_a_long_prompt_takes_the_budget() -> None:
    s = make_scheduler(max_num_batched_tokens=64)
    s.add_request(make_request("long", 200))
    s.add_request(make_request("short1", 10))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"long": 64}


def test_max_num_seqs_caps_running() -> None:
    s = make_scheduler(max_num_seqs=2)
    for i in range(4):
        s.add_request(make_request(f"r{i}", 5))
    out, _ = step(s)
    assert sorted(out.num_scheduled_tokens) == ["r0", "r1"]
    assert s.make_stats().num_waiting == 2


def test_new_requests_carry_full_data_running_ones_only_the_diff() -> None:
    s = make_scheduler(max_num_batched_tokens=64)
    s.add_request(make_request("a", 15, max_tokens=10))
    out, _ = step(s)
    (new,) = out.scheduled_new_reqs
    assert (new.block_ids, new.num_computed_tokens, new.num_prompt_tokens) == (([1, 2],), 0, 15)
    assert new.token_ids == list(range(1000, 1015))
    out, _ = step(s)  # token 16 still fits block 2
    (cached,) = out.scheduled_cached_reqs
    assert (cached.new_block_ids, cached.num_computed_tokens) == (([],), 15)
    out, _ = step(s)  # token 17 opens block 3
    assert out.scheduled_cached_reqs[0].new_block_ids == ([3],)
    assert out.scheduled_new_reqs == []


def test_bad_requests_and_config_raise() -> None:
    s = make_scheduler(max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len=32"):
        s.add_request(make_request("a", 33))
    with pytest.raises(ValueError, match="empty prompt"):
        s.add_request(make_request("e", []))
    s.add_request(make_request("b", 32))
    with pytest.raises(ValueError, match="already"):
        s.add_request(make_request("b", 3))
    with pytest.raises(ConfigError, match="--max-model-len"):
        Scheduler(EngineConfig(block_size=8), 4, 64)


def test_blocks_computed_this_step_are_not_hit_in_the_same_step() -> None:
    s = make_scheduler(max_num_batched_tokens=64)
    s.add_request(make_request("a", 20, max_tokens=4))
    s.add_request(make_request("b", 20, max_tokens=4))  # same prompt, same step: a's KV is not there yet
    out, _ = step(s)
    assert [(n.block_ids, n.num_computed_tokens) for n in out.scheduled_new_reqs] == [
        (([1, 2, 3],), 0),
        (([4, 5, 6],), 0),
    ]
    s.add_request(make_request("c", 20, max_tokens=4))  # a step later, a's two full blocks are cached
    out, _ = step(s)
    assert [(n.block_ids, n.num_computed_tokens) for n in out.scheduled_new_reqs] == [(([1, 2, 7],), 16)]
