"""The disk connector over a gemma3-like model (a full-attention and a sliding-window layer group): each
group's blocks have their own keys, and a window group loads only the blocks the window of the prefix
end covers. Exact block ids, no MLX."""

from __future__ import annotations

import pytest

from metalserve.config import EngineConfig
from metalserve.kvcache.connector.disk_keys import StoreNamespace
from metalserve.kvcache.connector.disk_scheduler import DiskConnectorScheduler
from metalserve.kvcache.specs import FullAttention, SlidingWindow
from metalserve.request import Request, RequestStatus
from metalserve.scheduler.scheduler import Scheduler
from tests.kvcache.connector_helpers import MemoryIndex
from tests.kvcache.test_connector_scheduler import request, run_to_end, step

BS = 8
WINDOW = 10  # the token at 31 reads 22..31: blocks 2 and 3
PROMPT_A = list(range(100, 133))  # 33 tokens: 4 full blocks and one token
PROMPT_B = list(range(200, 241))  # 41 tokens: takes every free block, evicting A's from RAM


def make_scheduler() -> tuple[Scheduler, MemoryIndex, DiskConnectorScheduler]:
    cfg = EngineConfig(block_size=BS, max_num_batched_tokens=64, max_num_seqs=4)
    s = Scheduler(cfg, num_blocks=18, max_model_len=64, kv_groups=[FullAttention(), SlidingWindow(WINDOW)])
    index = MemoryIndex()
    connector = DiskConnectorScheduler(index, StoreNamespace("m", block_size=BS), s.kv.chain_hashes, [None, WINDOW])
    s.set_connector(connector)
    return s, index, connector


def cold_then_evicted(s: Scheduler, index: MemoryIndex) -> Request:
    """A runs (its blocks of both groups are saved), then B evicts them from RAM."""
    a = request("a", PROMPT_A)
    s.add_request(a)
    out = step(s, index)
    assert out.scheduled_new_reqs[0].block_ids == ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    meta = out.kv_connector_metadata
    assert meta is not None
    assert [(t.block_id, t.group) for t in meta.saves] == [
        (1, 0),
        (6, 1),
        (2, 0),
        (7, 1),
        (3, 0),
        (8, 1),
        (4, 0),
        (9, 1),
    ]
    assert len({t.key for t in meta.saves}) == 8  # the group is in the key
    s.add_request(request("b", PROMPT_B))
    assert step(s, index).scheduled_new_reqs[0].block_ids == ([11, 12, 13, 14, 15, 16], [17, 5, 4, 3, 2, 1])
    run_to_end(s, index)
    return a


def test_a_disk_hit_loads_every_full_block_and_only_the_window_blocks() -> None:
    s, index, _ = make_scheduler()
    cold_then_evicted(s, index)
    s.add_request(request("a2", PROMPT_A))
    s.add_request(request("c", [900, 901]))
    out = step(s, index)
    meta = out.kv_connector_metadata
    assert meta is not None
    # Full group: blocks 0-3 into 10, 9, 8, 7; window group: only blocks 2 and 3 (into 15, 14), in block order.
    assert [(t.block_id, t.group) for t in meta.loads["a2"]] == [(10, 0), (9, 0), (8, 0), (15, 1), (7, 0), (14, 1)]
    assert [n.request_id for n in out.scheduled_new_reqs] == ["c"]
    assert s.requests["a2"].status is RequestStatus.WAITING_FOR_REMOTE_KVS
    step(s, index, finished_loads={"a2": 6})
    out = step(s, index)
    new = out.scheduled_new_reqs[0]
    # The window group's unloaded entries 0 and 1 went back to the pool (null) before anything published them.
    assert (new.request_id, new.block_ids, new.num_computed_tokens) == (
        "a2",
        ([10, 9, 8, 7, 11], [0, 0, 15, 14, 1]),
        32,
    )
    assert out.num_scheduled_tokens["a2"] == 1
    run_to_end(s, index)
    stats = s.make_stats().connector
    assert stats is not None and stats.hits == 32
    assert s.kv.num_free_blocks == s.kv.pool.num_usable_blocks


def test_window_blocks_outside_the_window_need_not_be_on_disk() -> None:
    s, index, connector = make_scheduler()
    a = cold_then_evicted(s, index)
    del index.stored[connector.namespaces[1].key(a.block_hashes[0])]  # behind the window of the prefix end
    del index.stored[connector.namespaces[1].key(a.block_hashes[1])]
    s.add_request(request("a2", PROMPT_A))
    meta = step(s, index).kv_connector_metadata
    assert meta is not None and len(meta.loads["a2"]) == 6  # still the whole 32-token prefix


def test_a_missing_window_block_shortens_the_prefix_to_what_every_group_has() -> None:
    s, index, connector = make_scheduler()
    a = cold_then_evicted(s, index)
    del index.stored[connector.namespaces[1].key(a.block_hashes[3])]
    s.add_request(request("a2", PROMPT_A))
    meta = step(s, index).kv_connector_metadata
    # 3 blocks: the window of token 23 reads 14..23: blocks 1 and 2 of the window group.
    assert meta is not None
    assert [(t.block_id, t.group) for t in meta.loads["a2"]] == [(10, 0), (9, 0), (6, 1), (8, 0), (16, 1)]
    step(s, index, finished_loads={"a2": 5})
    out = step(s, index)
    new = out.scheduled_new_reqs[0]
    # The window group's entry 0 (not loaded) went back; prefill resumes at token 24.
    assert (new.block_ids, new.num_computed_tokens) == (([10, 9, 8, 15, 14], [0, 6, 16, 13, 12]), 24)
    assert out.num_scheduled_tokens["a2"] == 9
    run_to_end(s, index)
    assert s.kv.num_free_blocks == s.kv.pool.num_usable_blocks


def test_a_partial_load_keeps_only_a_prefix_whose_window_blocks_arrived() -> None:
    s, index, _ = make_scheduler()
    cold_then_evicted(s, index)
    s.add_request(request("a2", PROMPT_A))
    step(s, index)
    # The full group's first three blocks arrived, the window group's first failed: no prefix is complete.
    step(s, index, finished_loads={"a2": 3})
    out = step(s, index)
    new = out.scheduled_new_reqs[0]
    assert (new.request_id, new.num_computed_tokens, out.num_scheduled_tokens["a2"]) == ("a2", 0, 33)
    run_to_end(s, index)
    assert s.make_stats().connector.hits == 0  # type: ignore[union-attr]
    assert s.kv.num_free_blocks == s.kv.pool.num_usable_blocks


def test_a_connector_built_for_other_layer_groups_is_refused() -> None:
    cfg = EngineConfig(block_size=BS, max_num_batched_tokens=64, max_num_seqs=4)
    s = Scheduler(cfg, num_blocks=18, max_model_len=64, kv_groups=[FullAttention(), SlidingWindow(WINDOW)])
    # One full-attention group's connector would save the window group's blocks as if it were full.
    connector = DiskConnectorScheduler(MemoryIndex(), StoreNamespace("m", block_size=BS), s.kv.chain_hashes)
    with pytest.raises(ValueError, match=r"for groups \[None\] cannot serve groups \[None, 10\]"):
        s.set_connector(connector)
