"""A grown pool gives its idle tail back (BlockPool.shrink, KVCacheManager.shrink_pool): exact block ids, what
stays cached, and the hysteresis that keeps a pool from swinging."""

from __future__ import annotations

from metalserve.kvcache.block_pool import BlockPool
from metalserve.kvcache.hashing import BlockHash
from metalserve.kvcache.manager import KVCacheManager
from tests.kvcache.kv_helpers import admit, make_request


def test_shrink_cuts_the_free_tail_and_evicts_what_it_cached() -> None:
    pool = BlockPool(32, initial_blocks=4)
    blocks = pool.get_new_blocks(3) + pool.get_new_blocks(12)  # 4 -> 16 blocks
    assert [b.block_id for b in blocks] == list(range(1, 16))
    by_id = {b.block_id: b for b in blocks}
    for i in (5, 9, 13):
        assert pool.cache_block(by_id[i], BlockHash(b"h%d" % i))
    pool.free_blocks(blocks)
    assert pool.num_used_blocks == 0 and pool.num_allocated_blocks == 16
    gone = pool.shrink(8)
    assert gone == [8, 9, 10, 11, 12, 13, 14, 15] and pool.num_allocated_blocks == 8
    assert pool.free_queue.block_ids() == [1, 2, 3, 4, 5, 6, 7]  # the kept blocks in their old order
    assert pool.get_cached_block(BlockHash(b"h5")) is by_id[5]  # below the cut: still a prefix hit
    assert pool.get_cached_block(BlockHash(b"h9")) is None and pool.get_cached_block(BlockHash(b"h13")) is None
    assert pool.num_evictions == 2
    assert pool.num_free_blocks == 31  # blocks not grown count as free, as before the growth
    again = pool.get_new_blocks(8)  # 6 plain free blocks: grows from 8 again, the new ids first
    assert [b.block_id for b in again] == [8, 9, 10, 11, 12, 13, 14, 15] and pool.num_allocated_blocks == 16


def test_shrink_never_cuts_below_a_held_block() -> None:
    pool = BlockPool(32, initial_blocks=4)
    blocks = pool.get_new_blocks(3) + pool.get_new_blocks(12)
    held = blocks[12]  # block 13
    pool.free_blocks(b for b in blocks if b is not held)
    assert pool.shrink(4) == [14, 15] and pool.num_allocated_blocks == 14
    assert held.ref_cnt == 1 and pool.num_used_blocks == 1
    pool.free_blocks([held])
    assert pool.shrink(4) == list(range(4, 14)) and pool.free_queue.block_ids() == [1, 2, 3]


def test_the_manager_shrinks_an_idle_pool_to_its_start_and_keeps_the_low_prefix_blocks() -> None:
    kv = KVCacheManager(64, block_size=4, initial_blocks=8)
    a = make_request("a", list(range(100, 128)))  # 7 blocks
    b = make_request("b", list(range(200, 240)))  # 10 blocks
    assert admit(kv, a) == ([1, 2, 3, 4, 5, 6, 7],)
    assert admit(kv, b) == ([8, 9, 10, 11, 12, 13, 14, 15, 16, 17],)
    kv.free(a)
    kv.free(b)
    assert kv.pool.num_allocated_blocks == 18
    assert kv.shrink_pool() == list(range(8, 18))  # back to the 8 it started with
    assert kv.pool.num_allocated_blocks == 8 and kv.pool.num_evictions == 10
    again = make_request("a2", list(range(100, 128)))
    assert kv.get_computed_blocks(again).block_ids == ([1, 2, 3, 4, 5, 6],)  # a's prefix survived the cut
    assert kv.get_computed_blocks(make_request("b2", list(range(200, 240)))).num_tokens == 0
    assert kv.shrink_pool() == []  # nothing grown: nothing to give


def test_the_manager_keeps_room_for_held_blocks_and_skips_small_gains() -> None:
    kv = KVCacheManager(64, block_size=4, initial_blocks=8)
    a = make_request("a", list(range(100, 128)))  # 7 blocks
    b = make_request("b", list(range(200, 212)))  # 3 blocks: 1 free, so the pool doubles to 16
    assert admit(kv, a) == ([1, 2, 3, 4, 5, 6, 7],)
    assert admit(kv, b) == ([8, 9, 10],)
    kv.free(b)
    # 7 held: keep 8 + 7 = 15 of 16; one block is less than a quarter of the pool: no churn for it.
    assert kv.shrink_pool() == [] and kv.pool.num_allocated_blocks == 16
    c = make_request("c", list(range(300, 312)))
    assert admit(kv, c) == ([11, 12, 13],)  # plain free blocks before b's cached ones
    kv.free(a)
    # 3 held: keep 8 + 3 = 11, but block 13 is held, so the cut is above it.
    assert kv.shrink_pool() == [14, 15] and kv.pool.num_allocated_blocks == 14
    hit = kv.get_computed_blocks(make_request("b2", list(range(200, 212)) + [7]))
    assert hit.block_ids == ([8, 9, 10],)  # b's cached blocks lay below the cut
