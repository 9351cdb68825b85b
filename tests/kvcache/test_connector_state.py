"""The disk connector over a hybrid model (a full-attention and a recurrent-state layer group): a state
is saved under a block's key only when a step ends exactly on that block's last token (the snapshot), and
a prefix loads every full-attention block but only the snapshot of its last block. Exact block ids, no MLX."""

from __future__ import annotations

import pytest

from metalserve.config import EngineConfig
from metalserve.kvcache.connector.disk_keys import StoreNamespace
from metalserve.kvcache.connector.disk_scheduler import RECURRENT_STATE, DiskConnectorScheduler
from metalserve.kvcache.specs import FullAttention, RecurrentState
from metalserve.request import Request, RequestStatus
from metalserve.scheduler.scheduler import Scheduler
from tests.kvcache.connector_helpers import MemoryIndex
from tests.kvcache.test_connector_scheduler import request, run_to_end, step

BS = 8
PROMPT_A = list(range(100, 133))  # 33 tokens: 4 full blocks and one token
PROMPT_B = list(range(200, 255))  # 55 tokens: takes every free block, evicting A's from RAM


def make_scheduler() -> tuple[Scheduler, MemoryIndex, DiskConnectorScheduler]:
    # A budget of 16 tokens: prefill chunks end at 16 and 32, so A's snapshots are those of blocks 1 and 3.
    cfg = EngineConfig(block_size=BS, max_num_batched_tokens=16, max_num_seqs=4)
    s = Scheduler(cfg, num_blocks=12, max_model_len=64, kv_groups=[FullAttention(), RecurrentState()])
    index = MemoryIndex()
    needs = [None, RECURRENT_STATE]
    connector = DiskConnectorScheduler(index, StoreNamespace("m", block_size=BS), s.kv.chain_hashes, needs)
    s.set_connector(connector)
    return s, index, connector


def saves(out: object) -> list[tuple[int, int]]:
    meta = getattr(out, "kv_connector_metadata", None)
    return [] if meta is None else [(t.block_id, t.group) for t in meta.saves]


def cold(s: Scheduler, index: MemoryIndex) -> Request:
    """A runs in three steps (16, 16 and 1 tokens); each step's state is saved only on a block boundary."""
    a = request("a", PROMPT_A)
    s.add_request(a)
    out = step(s, index)
    assert out.scheduled_new_reqs[0].block_ids == ([1, 2], [0, 3])
    assert saves(out) == [(1, 0), (2, 0), (3, 1)]  # the state after token 16: block 1's snapshot
    out = step(s, index)
    assert out.scheduled_cached_reqs[0].new_block_ids == ([4, 5], [0, 6])
    assert saves(out) == [(4, 0), (5, 0), (6, 1)]  # block 3's snapshot (entry 1, the state it read, is not)
    out = step(s, index)
    assert out.scheduled_cached_reqs[0].new_block_ids == ([7], [8])
    assert saves(out) == []  # 33 tokens: no block ends, and the state after token 33 is no snapshot
    assert not s.requests
    return a


def evicted_by_b(s: Scheduler, index: MemoryIndex) -> None:
    s.add_request(request("b", PROMPT_B))
    out = step(s, index)
    assert out.scheduled_new_reqs[0].block_ids == ([9, 10], [0, 11])
    run_to_end(s, index)


def test_a_disk_hit_loads_every_full_block_and_only_the_last_snapshot() -> None:
    s, index, _ = make_scheduler()
    cold(s, index)
    evicted_by_b(s, index)
    s.add_request(request("a2", PROMPT_A))
    meta = step(s, index).kv_connector_metadata
    assert meta is not None
    # Full group: blocks 0-3 into 11, 5, 8, 2; state group: block 3's snapshot alone, into 4.
    assert [(t.block_id, t.group) for t in meta.loads["a2"]] == [(11, 0), (5, 0), (8, 0), (2, 0), (4, 1)]
    assert s.requests["a2"].status is RequestStatus.WAITING_FOR_REMOTE_KVS
    step(s, index, finished_loads={"a2": 5})
    out = step(s, index)
    new = out.scheduled_new_reqs[0]
    # Resumes at 32 from the loaded state in entry 3; the step's state goes to a new entry 4.
    assert (new.request_id, new.block_ids, new.num_computed_tokens) == ("a2", ([11, 5, 8, 2, 7], [0, 0, 0, 4, 3]), 32)
    assert out.num_scheduled_tokens["a2"] == 1
    run_to_end(s, index)
    stats = s.make_stats().connector
    assert stats is not None and stats.hits == 32
    assert s.kv.num_free_blocks == s.kv.pool.num_usable_blocks


def test_without_the_last_snapshot_the_prefix_ends_at_the_one_before() -> None:
    s, index, connector = make_scheduler()
    a = cold(s, index)
    evicted_by_b(s, index)
    del index.stored[connector.namespaces[1].key(a.block_hashes[3])]
    s.add_request(request("a2", PROMPT_A))
    meta = step(s, index).kv_connector_metadata
    assert meta is not None
    # No snapshot of block 2 was ever saved (no step ended at 24): the prefix is 16 tokens.
    assert [(t.block_id, t.group) for t in meta.loads["a2"]] == [(11, 0), (5, 0), (8, 1)]
    step(s, index, finished_loads={"a2": 3})
    out = step(s, index)
    new = out.scheduled_new_reqs[0]
    assert (new.block_ids, new.num_computed_tokens) == (([11, 5, 2, 4], [0, 8, 0, 7]), 16)
    assert out.num_scheduled_tokens["a2"] == 16
    run_to_end(s, index)
    assert s.kv.num_free_blocks == s.kv.pool.num_usable_blocks


def test_a_lost_snapshot_recomputes_from_zero_and_gives_its_block_back() -> None:
    s, index, _ = make_scheduler()
    cold(s, index)
    evicted_by_b(s, index)
    s.add_request(request("a2", PROMPT_A))
    step(s, index)
    # The four full blocks arrived, the snapshot did not: no prefix is complete without its state.
    step(s, index, finished_loads={"a2": 4})
    out = step(s, index)
    new = out.scheduled_new_reqs[0]
    # The state entry the snapshot was to load into (block 4) went back (to the free queue's end): the state
    # table started empty, and the first chunk's state goes to a fresh block.
    assert (new.block_ids, new.num_computed_tokens, out.num_scheduled_tokens["a2"]) == (([11, 5, 8, 2], [0, 7]), 0, 16)
    run_to_end(s, index)
    stats = s.make_stats().connector
    assert stats is not None and stats.hits == 0
    assert s.kv.num_free_blocks == s.kv.pool.num_usable_blocks


def evict_blocks(s: Scheduler, block_ids: list[int]) -> None:
    """RAM pressure on chosen free cached blocks only (what other requests' allocations would do)."""
    pool = s.kv.pool
    for i in block_ids:
        block = pool.blocks[i]
        assert block.ref_cnt == 0 and block.block_hash is not None
        pool._evict(block)
        pool._num_free_cached -= 1


def test_a_ram_hit_continues_from_disk_and_falls_back_to_its_own_snapshot() -> None:
    s, index, _ = make_scheduler()
    cold(s, index)
    evict_blocks(s, [4, 5, 6])  # A's full blocks 2, 3 and block 3's snapshot; blocks 0, 1 and snapshot 1 stay
    s.add_request(request("a2", PROMPT_A))
    meta = step(s, index).kv_connector_metadata
    assert meta is not None
    # RAM: full blocks 1, 2 and the snapshot of block 1 (3); disk: blocks 2, 3 and block 3's snapshot, into
    # the blocks never used yet (9, 10, 11) at the free queue's head.
    assert [(t.block_id, t.group) for t in meta.loads["a2"]] == [(9, 0), (10, 0), (11, 1)]
    assert s.kv.get_block_ids("a2") == ([1, 2, 9, 10], [0, 3, 0, 11])
    step(s, index, finished_loads={"a2": 2})  # the snapshot is lost: back to the RAM hit's 16 tokens
    out = step(s, index)
    new = out.scheduled_new_reqs[0]
    # It reads the RAM snapshot (3) again; 11, where the lost one was to go, went back; the chunk's state
    # ends at 32 in a fresh block.
    assert (new.block_ids, new.num_computed_tokens, out.num_scheduled_tokens["a2"]) == (
        ([1, 2, 9, 10], [0, 3, 0, 7]),
        16,
        16,
    )
    run_to_end(s, index)
    assert s.make_stats().connector.hits == 0  # type: ignore[union-attr]
    assert s.kv.num_free_blocks == s.kv.pool.num_usable_blocks

    # The same with the snapshot intact: resumes at 32, the RAM snapshot's entry is given back.
    s, index, _ = make_scheduler()
    cold(s, index)
    evict_blocks(s, [4, 5, 6])
    s.add_request(request("a2", PROMPT_A))
    step(s, index)
    step(s, index, finished_loads={"a2": 3})
    out = step(s, index)
    new = out.scheduled_new_reqs[0]
    assert (new.block_ids, new.num_computed_tokens) == (([1, 2, 9, 10, 7], [0, 0, 0, 11, 5]), 32)
    snapshot_1 = s.kv.pool.blocks[3]  # no longer read: free again, and still cached in RAM
    assert snapshot_1.ref_cnt == 0 and snapshot_1.block_hash is not None
    run_to_end(s, index)
    assert s.make_stats().connector.hits == 16  # type: ignore[union-attr]
    assert s.kv.num_free_blocks == s.kv.pool.num_usable_blocks


def test_a_decode_step_ending_a_block_saves_its_snapshot() -> None:
    s, index, _ = make_scheduler()
    s.add_request(request("d", list(range(300, 314)), max_tokens=4))  # 14 tokens, then 2 decoded reach 16
    got = [saves(step(s, index)) for _ in range(4)]
    # Step 1: 14 tokens (block 0's pages; the state after 14 is no snapshot); 2: token 15; 3: token 16 ends
    # block 1: its pages and its snapshot.
    assert got == [[(1, 0)], [], [(2, 0), (3, 1)], []]


def test_a_connector_built_without_the_state_group_is_refused() -> None:
    cfg = EngineConfig(block_size=BS, max_num_batched_tokens=16, max_num_seqs=4)
    s = Scheduler(cfg, num_blocks=12, max_model_len=64, kv_groups=[FullAttention(), RecurrentState()])
    # Treated as full attention, the state group's entries would be saved at positions they do not hold.
    namespace = StoreNamespace("m", block_size=BS)
    connector = DiskConnectorScheduler(MemoryIndex(), namespace, s.kv.chain_hashes, [None, None])
    with pytest.raises(ValueError, match=r"cannot serve groups \[None, 'state'\]"):
        s.set_connector(connector)


def test_a_state_the_step_only_read_is_never_saved_as_a_snapshot() -> None:
    """A step from 13 to 24 tokens (a verify window, say) reads entry 1 (the state after 13) and writes
    entry 2 (after 24): only entry 2 is a snapshot, of block 2; block 1 has none."""
    s, index, connector = make_scheduler()
    r = request("x", list(range(400, 430)))
    s.kv.hash_prompt(r)
    r.num_computed_tokens = 24
    meta = connector.build_connector_meta({"x": 11}, {"x": r}, lambda _: ([1, 2, 3], [0, 5, 9]))
    assert [(t.block_id, t.group) for t in meta.saves] == [(2, 0), (3, 0), (9, 1)]
    assert meta.saves[-1].key == connector.namespaces[1].key(r.block_hashes[2])
    s, index, connector = make_scheduler()  # a fresh store: nothing pending
    r.num_computed_tokens = 23  # a step that ends inside a block leaves no snapshot at all
    meta = connector.build_connector_meta({"x": 10}, {"x": r}, lambda _: ([1, 2, 3], [0, 5, 9]))
    assert [(t.block_id, t.group) for t in meta.saves] == [(2, 0)]
