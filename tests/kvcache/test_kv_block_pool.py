"""The block pool and its O(1) LRU free queue, to the exact block id."""

from __future__ import annotations

import pytest

from metalserve.kvcache.block_pool import BlockPool, FreeBlockQueue, KVBlock
from metalserve.kvcache.hashing import BlockHash


def test_free_queue_pops_head_appends_tail_and_removes_from_middle() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert q.block_ids() == [0, 1, 2, 3, 4]
    assert q.popleft().block_id == 0
    q.remove(blocks[2])
    assert q.block_ids() == [1, 3, 4]
    q.append(blocks[0])
    assert q.block_ids() == [1, 3, 4, 0]
    assert len(q) == 4


def test_free_queue_rejects_double_insert_and_foreign_remove() -> None:
    blocks = [KVBlock(i) for i in range(2)]
    q = FreeBlockQueue(blocks)
    with pytest.raises(ValueError, match="already in the free queue"):
        q.append(blocks[0])
    taken = q.popleft()
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(taken)
    q.popleft()
    with pytest.raises(IndexError):
        q.popleft()


def test_pool_reserves_null_block_and_allocates_from_head() -> None:
    pool = BlockPool(5)
    assert pool.num_usable_blocks == 4
    assert pool.free_queue.block_ids() == [1, 2, 3, 4]
    got = pool.get_new_blocks(2)
    assert [b.block_id for b in got] == [1, 2]
    assert [b.ref_cnt for b in got] == [1, 1]
    assert pool.usage == pytest.approx(0.5)
    with pytest.raises(ValueError, match="only 2 free"):
        pool.get_new_blocks(3)


def test_pool_free_order_and_eviction_of_cached_block() -> None:
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    assert pool.cache_block(b, BlockHash(b"h-b"))
    pool.free_blocks([c, b, a])
    assert pool.free_queue.block_ids() == [3, 2, 1]
    assert pool.get_cached_block(BlockHash(b"h-b")) is b
    got = pool.get_new_blocks(2)  # takes 3 then 2: block 2's cached content is evicted
    assert [x.block_id for x in got] == [3, 2]
    assert pool.get_cached_block(BlockHash(b"h-b")) is None
    assert b.block_hash is None
    assert pool.num_evictions == 1


def test_pool_touch_takes_cached_free_block_out_of_queue() -> None:
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, BlockHash(b"h-a"))
    pool.free_blocks([b, a])
    assert pool.free_queue.block_ids() == [3, 2, 1]
    pool.touch([a])
    assert a.ref_cnt == 1
    assert pool.free_queue.block_ids() == [3, 2]
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free_blocks([a])
    assert pool.free_queue.block_ids() == [3, 2]
    with pytest.raises(ValueError, match="freed more often"):
        pool.free_blocks([b])


def test_pool_refuses_duplicate_hash() -> None:
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_block(a, BlockHash(b"same"))
    assert not pool.cache_block(b, BlockHash(b"same"))
    assert b.block_hash is None


def test_pool_needs_a_usable_block() -> None:
    with pytest.raises(ValueError, match="more than 1"):
        BlockPool(1)


def test_a_growing_pool_doubles_when_free_blocks_run_out_and_keeps_ids() -> None:
    pool = BlockPool(10, initial_blocks=4)
    assert pool.num_allocated_blocks == 4 and pool.free_queue.block_ids() == [1, 2, 3]
    assert pool.num_free_blocks == 9 and pool.usage == 0.0  # blocks not grown yet count as free
    a = pool.get_new_blocks(2)
    assert [b.block_id for b in a] == [1, 2]
    b = pool.get_new_blocks(2)  # one free block is not enough: 4 -> 8, new blocks first
    assert [x.block_id for x in b] == [4, 5] and pool.num_allocated_blocks == 8
    assert pool.free_queue.block_ids() == [6, 7, 3] and pool.num_free_blocks == 5
    c = pool.get_new_blocks(5)  # 3 free + the last 2 grown: 8 -> 10, capped
    assert [x.block_id for x in c] == [8, 9, 6, 7, 3] and pool.num_allocated_blocks == 10
    assert pool.num_free_blocks == 0
    with pytest.raises(ValueError, match="only 0 free"):
        pool.get_new_blocks(1)


def test_a_growing_pool_grows_before_it_evicts_a_cached_block() -> None:
    pool = BlockPool(8, initial_blocks=3)
    x, y = pool.get_new_blocks(2)
    assert pool.cache_block(x, BlockHash(b"h-x"))
    pool.free_blocks([y, x])  # free queue: 2 (plain), 1 (cached)
    got = pool.get_new_blocks(2)  # one plain free block: grow instead of evicting block 1
    assert [b.block_id for b in got] == [3, 4] and pool.num_allocated_blocks == 6
    assert pool.get_cached_block(BlockHash(b"h-x")) is x and pool.num_evictions == 0
    pool.touch([x])  # a prefix hit takes the cached block out of the free queue
    assert pool.free_queue.block_ids() == [5, 2]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [5, 2] and pool.num_allocated_blocks == 6
