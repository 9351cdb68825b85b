"""Admission control, preemption by recompute, policies and prefix hits after preemption."""

from __future__ import annotations

from metalserve.request import RequestStatus
from tests.scheduler.sched_helpers import make_request, make_scheduler, step


def test_admission_waits_for_blocks_and_drops_nothing() -> None:
    s = make_scheduler(num_blocks=5, max_model_len=32)  # 4 usable blocks of 8
    s.add_request(make_request("a", 24, max_tokens=1, arrival=0))
    s.add_request(make_request("b", 16, max_tokens=1, arrival=1))
    out, _ = step(s)
    assert list(out.num_scheduled_tokens) == ["a"]  # b needs 2 blocks, 1 is free: it waits
    assert s.requests["b"].status is RequestStatus.WAITING
    out, outputs = step(s)
    assert [o.request_id for o in outputs] == ["b"]
    assert out.finished_req_ids == {"a"}
    assert not s.has_unfinished_requests()


def test_preempts_latest_arrival_and_resumes_with_own_cached_blocks() -> None:
    s = make_scheduler(num_blocks=5, max_model_len=32)
    s.add_request(make_request("a", 16, max_tokens=8, arrival=0))
    s.add_request(make_request("b", list(range(2000, 2016)), max_tokens=8, arrival=1))
    assert s.requests["b"].num_cached_tokens is None  # not a sentinel count: unknown until scheduled
    out, _ = step(s)
    assert [r.block_ids for r in out.scheduled_new_reqs] == [([1, 2],), ([3, 4],)]
    out, _ = step(s)  # a needs a third block: b (latest) is preempted, its tail block goes to a
    assert out.preempted_req_ids == {"b"}
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.scheduled_cached_reqs[0].new_block_ids == ([4],)
    b = s.requests["b"]
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    first = s.make_stats()
    assert (first.num_preemptions, first.step_preemptions) == (1, 1)
    assert (first.prefix_cache_queries, first.step_prefix_cache_queries) == (32, 32)
    again = s.make_stats()  # per-step deltas count from the previous snapshot
    assert (again.num_preemptions, again.step_preemptions, again.step_prefix_cache_queries) == (1, 0, 0)
    assert s.kv.pool.free_queue.block_ids() == [3]  # b's cached first block survives, unevicted
    while "a" in s.requests:
        step(s)
    # a freed 4, 2, 1 (tail first); 1 and 2 hold a's cached prefix.
    assert s.kv.pool.free_queue.block_ids() == [3, 4, 2, 1]
    out, _ = step(s)  # b comes back as a new request with its tokens so far and hits block 3
    (new,) = out.scheduled_new_reqs
    assert new.request_id == "b"
    assert new.token_ids == list(range(2000, 2016)) + [7]
    assert (new.block_ids, new.num_computed_tokens) == (([3, 4, 2],), 8)
    assert out.num_scheduled_tokens == {"b": 9}
    assert [s.kv.pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [0, 1, 1, 1]
    assert s.requests["b"].num_cached_tokens == 0  # counted at first scheduling only
    stats = s.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (16 + 16 + 17, 8)
    assert (stats.step_prefix_cache_queries, stats.step_prefix_cache_hits) == (17, 8)


def test_priority_policy_orders_waiting_and_picks_victim() -> None:
    s = make_scheduler(num_blocks=6, max_model_len=32, scheduling_policy="priority")
    s.add_request(make_request("low", 16, max_tokens=8, arrival=0, priority=5))
    s.add_request(make_request("high", 16, max_tokens=8, arrival=1, priority=0))
    s.add_request(make_request("mid", 8, max_tokens=8, arrival=2, priority=1))
    out, _ = step(s)
    assert [r.request_id for r in out.scheduled_new_reqs] == ["high", "mid", "low"]
    out, _ = step(s)
    # "low" arrived first but has the lowest priority: it is the victim, not "mid".
    assert out.preempted_req_ids == {"low"}
    assert out.num_scheduled_tokens == {"high": 1, "mid": 1}


def test_victim_scheduled_earlier_in_the_step_is_taken_back() -> None:
    s = make_scheduler(num_blocks=4, max_model_len=24, scheduling_policy="priority")
    s.add_request(make_request("x", 4, max_tokens=8, arrival=0, priority=9))
    s.add_request(make_request("y", 16, max_tokens=8, arrival=1, priority=0))
    step(s)
    assert [r.request_id for r in s.running] == ["y", "x"]
    s.running.reverse()  # x is scheduled first this step, then y must grow and preempts it
    out, _ = step(s)
    assert out.preempted_req_ids == {"x"}
    assert out.num_scheduled_tokens == {"y": 1}
    assert out.total_num_scheduled_tokens == 1
    assert [c.request_id for c in out.scheduled_cached_reqs] == ["y"]


def test_no_admission_in_a_step_that_preempted() -> None:
    s = make_scheduler(num_blocks=5, max_model_len=32)
    s.add_request(make_request("a", 16, max_tokens=8, arrival=0))
    s.add_request(make_request("b", 16, max_tokens=8, arrival=1))
    step(s)
    s.add_request(make_request("c", 1, max_tokens=1, arrival=2))
    out, _ = step(s)
    assert out.preempted_req_ids == {"b"}
    assert "c" not in out.num_scheduled_tokens


def test_fcfs_waiting_order_and_preempted_goes_back_to_head() -> None:
    s = make_scheduler(num_blocks=5, max_model_len=32)
    s.add_request(make_request("a", 16, max_tokens=8, arrival=0))
    s.add_request(make_request("b", 16, max_tokens=8, arrival=1))
    step(s)
    s.add_request(make_request("c", 8, max_tokens=1, arrival=2))
    step(s)  # preempts b
    assert [r.request_id for r in s.waiting] == ["b", "c"]
