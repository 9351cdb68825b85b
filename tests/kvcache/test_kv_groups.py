"""Layer groups over one block pool: exact block ids for window freeing, shared pools, per-group
prefix hits and recurrent-state snapshots."""

from __future__ import annotations

from collections.abc import Sequence

from metalserve.kvcache.manager import BlockIds, KVCacheManager
from metalserve.kvcache.specs import (
    FullAttention,
    LayerGroupSpec,
    RecurrentState,
    SlidingWindow,
    prefix_caching_problem,
)
from metalserve.request import Request
from tests.kvcache.kv_helpers import admit, make_request

BS = 4


def manager(specs: Sequence[LayerGroupSpec], num_blocks: int, block_size: int, **kw: bool) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size, groups=specs, **kw)


def tables(kv: KVCacheManager, rid: str) -> list[list[int]]:
    return list(kv.get_block_ids(rid))


def decode(kv: KVCacheManager, req: Request, token: int) -> list[list[int]] | None:
    """One decode step: a new token, its slots, then (as if the step ran) one more computed token."""
    req.output_token_ids.append(token)
    ids: BlockIds | None = kv.allocate_slots(req, 1)
    req.num_computed_tokens += 1
    return None if ids is None else list(ids)


def test_one_manager_for_every_model_one_full_group_by_default() -> None:
    assert [type(g).__name__ for g in KVCacheManager(8, BS).groups] == ["FullAttentionGroup"]
    assert [type(g).__name__ for g in manager([SlidingWindow(8)], 8, BS).groups] == ["SlidingWindowGroup"]


def test_window_blocks_go_back_to_the_pool_as_the_window_moves() -> None:
    kv = manager([FullAttention(), SlidingWindow(4)], 30, BS)
    a = make_request("a", list(range(10)))
    assert admit(kv, a) == ([1, 2, 3], [4, 5, 6])
    # Token 10 reads positions 7..10: block 0 of the window (positions 0..3) is out for good.
    assert decode(kv, a, 50) == [[], []]
    assert tables(kv, "a") == [[1, 2, 3], [0, 5, 6]]
    assert kv.pool.free_queue.block_ids()[-1] == 4
    assert decode(kv, a, 51) == [[], []]  # token 11 reads 8..11: block 1 (4..7) goes too
    assert tables(kv, "a") == [[1, 2, 3], [0, 0, 6]]
    assert kv.pool.free_queue.block_ids()[-2:] == [4, 5]
    assert decode(kv, a, 52) == [[7], [8]]  # token 12 starts a block in both groups
    assert tables(kv, "a") == [[1, 2, 3, 7], [0, 0, 6, 8]]
    kv.free(a)
    assert kv.pool.free_queue.block_ids()[-6:] == [7, 3, 2, 1, 8, 6]


def test_freed_window_blocks_stop_counting_against_admission() -> None:
    kv = manager([FullAttention(), SlidingWindow(4)], 9, BS, enable_caching=False)
    a = make_request("a", list(range(12)))
    assert admit(kv, a) == ([1, 2, 3], [4, 5, 6])
    assert kv.num_free_blocks == 2
    # Token 12 needs a block per group, and the window frees two (positions 0..7 are behind it).
    assert decode(kv, a, 50) == [[7], [8]]
    assert tables(kv, "a") == [[1, 2, 3, 7], [0, 0, 6, 8]]
    assert kv.num_free_blocks == 2
    b = make_request("b", list(range(100, 104)))
    assert admit(kv, b) == ([5], [4])  # the freed window blocks, in the order they were freed
    assert kv.num_free_blocks == 0
    assert kv.allocate_slots(make_request("c", [1]), 1) is None


def test_a_window_hit_needs_only_the_windows_blocks() -> None:
    kv = manager([SlidingWindow(4)], 12, BS)
    a = make_request("a", list(range(10)))
    assert admit(kv, a) == ([1, 2, 3],)
    assert [decode(kv, a, t) for t in (50, 51, 52)] == [[[]], [[]], [[4]]]
    assert tables(kv, "a") == [[0, 0, 3, 4]]  # blocks 1 and 2 fell out of the window (published first)
    kv.free(a)
    assert kv.pool.free_queue.block_ids() == [5, 6, 7, 8, 9, 10, 11, 1, 2, 4, 3]
    kv.pool.get_new_blocks(9)  # the never-used blocks, then evicts 1 and 2 (positions 0..7)
    b = make_request("b", [*range(10), 50, 51, 52, 77])
    hit = kv.get_computed_blocks(b)
    # Position 12 reads 9..12: only block 3 (8..11) is needed, and it is still cached.
    assert (hit.num_tokens, hit.block_ids) == (12, ([0, 0, 3],))
    assert kv.allocate_slots(b, 2, hit) == ([0, 0, 3, 4],)  # null entries pad the table; 4 was never cached
    assert kv.pool.blocks[3].ref_cnt == 1


def test_window_hit_stops_where_its_window_is_not_cached() -> None:
    kv = manager([SlidingWindow(6)], 12, BS)
    a = make_request("a", list(range(13)))
    admit(kv, a)
    kv.free(a)
    kv.pool.get_new_blocks(8)  # the 7 never-used blocks and block 4; the next to go is 3
    kv.pool.get_new_blocks(1)  # evicts block 3 (positions 8..11)
    b = make_request("b", list(range(13)) + [77])
    hit = kv.get_computed_blocks(b)
    # End 3 needs blocks 1..2 (positions 7..11) but 2 is gone; end 2 needs blocks 0..1: cached.
    assert (hit.num_tokens, hit.block_ids) == (8, ([1, 2],))


def test_one_pool_shared_by_full_window_and_state_groups() -> None:
    kv = manager([FullAttention(), SlidingWindow(4), RecurrentState()], 30, BS)
    a = make_request("a", list(range(10)))
    # The state of 10 tokens lives in entry (10 - 1) // 4 = 2; the entries before it are null.
    assert admit(kv, a) == ([1, 2, 3], [4, 5, 6], [0, 0, 7])
    assert kv.num_free_blocks == 22
    assert decode(kv, a, 50) == [[], [], []]
    assert decode(kv, a, 51) == [[], [], []]
    assert tables(kv, "a") == [[1, 2, 3], [0, 0, 6], [0, 0, 7]]
    # 12 tokens: a boundary. Block 7 holds the state of 3 whole blocks (a snapshot) and is read by
    # this step, which writes the state of 13 tokens to a new entry.
    assert decode(kv, a, 52) == [[8], [9], [10]]
    assert tables(kv, "a") == [[1, 2, 3, 8], [0, 0, 6, 9], [0, 0, 7, 10]]
    assert decode(kv, a, 53) == [[], [], []]  # the snapshot is no longer read: freed, still cached
    assert tables(kv, "a") == [[1, 2, 3, 8], [0, 0, 6, 9], [0, 0, 0, 10]]  # 13 reads 10..13
    assert kv.pool.blocks[7].ref_cnt == 0 and kv.pool.blocks[7].block_hash is not None
    kv.free(a)
    assert kv.pool.free_queue.block_ids()[-8:] == [7, 8, 3, 2, 1, 9, 6, 10]
    assert kv.num_free_blocks == kv.pool.num_usable_blocks


def test_a_prefix_hit_resumes_from_a_state_snapshot() -> None:
    kv = manager([FullAttention(), SlidingWindow(4), RecurrentState()], 30, BS)
    a = make_request("a", list(range(10)))
    admit(kv, a)
    for token in (50, 51, 52, 53):
        decode(kv, a, token)
    kv.free(a)
    b = make_request("b", [*range(10), 50, 51, 52, 53, 99])
    hit = kv.get_computed_blocks(b)
    assert hit.num_tokens == 12  # the snapshot after 3 blocks; block 3 (12..15) is not full
    assert kv.allocate_slots(b, b.num_tokens - 12, hit) == ([1, 2, 3, 11], [0, 0, 6, 12], [0, 0, 7, 13])
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (10 + 15, 12)


def test_state_hit_needs_a_snapshot_at_the_hit_end() -> None:
    kv = manager([FullAttention(), RecurrentState()], 30, BS)
    a = make_request("a", list(range(10)))
    admit(kv, a)  # one chunk of 10 tokens: only the state at 10 exists, no boundary snapshot
    kv.free(a)
    b = make_request("b", list(range(12)))
    assert kv.get_computed_blocks(b).num_tokens == 0  # full attention has 2 blocks, the state none
    c = make_request("c", list(range(8)))
    # Its hit would be 1 block in full attention, none in the state; 8 tokens end on a boundary:
    # block 7 becomes a snapshot.
    assert admit(kv, c) == ([5, 6], [0, 7])
    kv.free(c)
    hit = kv.get_computed_blocks(b)
    assert hit.num_tokens == 8
    assert hit.block_ids[0] == [1, 2]  # a's blocks: c's equal ones were never published twice
    assert kv.allocate_slots(b, 4, hit) == ([1, 2, 8], [0, 7, 9])


def test_a_state_without_snapshots_turns_prefix_caching_off() -> None:
    specs = [FullAttention(), RecurrentState(snapshots=False)]
    assert "cannot be snapshotted" in (prefix_caching_problem(specs) or "")
    assert prefix_caching_problem([FullAttention(), RecurrentState()]) is None
    kv = manager(specs, 30, BS)
    assert not kv.enable_caching and not kv.align_chunks
    a = make_request("a", list(range(8)))
    admit(kv, a)
    kv.free(a)
    assert kv.pool.cached == {}
    assert kv.get_computed_blocks(make_request("b", list(range(12)))).num_tokens == 0


def test_one_request_of_the_full_context_needs_every_groups_blocks() -> None:
    specs = [FullAttention(), SlidingWindow(8), RecurrentState()]
    assert manager(specs, 30, BS).blocks_for_request(10) == 3 + 3 + 2
    assert KVCacheManager(30, BS).blocks_for_request(10) == 3
