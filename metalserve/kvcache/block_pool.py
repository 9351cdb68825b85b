"""Fixed-size KV blocks with reference counts, an O(1) LRU free queue and the prefix-cache map."""

from __future__ import annotations

from collections.abc import Iterable

from metalserve.kvcache.hashing import BlockHash

# Block 0 is the null block: never handed out, so the runner may pad block tables with it.
NULL_BLOCK_ID = 0
NUM_RESERVED_BLOCKS = 1


class KVBlock:
    """One block of `block_size` token slots in every layer's K/V pool.

    `ref_cnt` counts the requests whose block table holds it. `block_hash` is set while the block is
    published in the prefix cache. `prev_free`/`next_free` link it into the free queue while free.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Free blocks in eviction order, as a doubly linked list threaded through the blocks themselves.

    Allocation pops the head (the least recently freed block), freeing appends to the tail, and a
    cached block that is hit again unlinks itself from the middle: all three are O(1), where a Python
    list would need an O(n) scan to remove a block from the middle. Two sentinels avoid None checks.
    """

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def prepend(self, blocks: list[KVBlock]) -> None:
        """Put never-used blocks at the head, in order: they go out before any cached block is evicted."""
        for block in reversed(blocks):
            first = self._head.next_free
            assert first is not None and block.prev_free is None
            block.prev_free, block.next_free = self._head, first
            first.prev_free = block
            self._head.next_free = block
            self._len += 1

    def append(self, block: KVBlock) -> None:
        if block.prev_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._len += 1

    def block_ids(self) -> list[int]:
        """Head to tail: the order in which blocks will be handed out (for tests and debugging)."""
        ids: list[int] = []
        node = self._head.next_free
        while node is not None and node is not self._tail:
            ids.append(node.block_id)
            node = node.next_free
        return ids


class BlockPool:
    """All blocks of the KV cache, the free queue and the hash -> block map of cached full blocks.

    With `initial_blocks` below `num_blocks` the pool starts small and grows (doubling) when an
    allocation would otherwise evict a cached block or fail, so the runner allocates memory as it is
    used; block ids never move. Blocks not yet grown count as free for admission. `shrink` gives the
    grown tail back at idle (the engine calls it; see there for the policy).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, initial_blocks: int | None = None) -> None:
        if num_blocks <= NUM_RESERVED_BLOCKS:
            raise ValueError(f"num_blocks must be more than {NUM_RESERVED_BLOCKS}, got {num_blocks}")
        start = num_blocks if initial_blocks is None else min(max(initial_blocks, NUM_RESERVED_BLOCKS + 1), num_blocks)
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.initial_blocks = start
        self.blocks = [KVBlock(i) for i in range(start)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.free_queue = FreeBlockQueue(self.blocks[NUM_RESERVED_BLOCKS:])
        self.cached: dict[BlockHash, KVBlock] = {}
        self.num_evictions = 0
        self._num_free_cached = 0  # free blocks still holding a cached hash

    @property
    def num_allocated_blocks(self) -> int:
        """Blocks grown so far: the runner's pools hold this many."""
        return len(self.blocks)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - NUM_RESERVED_BLOCKS

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue) + self.num_blocks - len(self.blocks)

    def _grow_for(self, n: int) -> None:
        """Grow (doubling, at least by the shortfall) when `n` blocks would otherwise evict or fail."""
        shortfall = n - (len(self.free_queue) - self._num_free_cached)
        if shortfall <= 0 or len(self.blocks) == self.num_blocks:
            return
        start = len(self.blocks)
        stop = min(self.num_blocks, max(2 * start, start + shortfall))
        new = [KVBlock(i) for i in range(start, stop)]
        self.blocks += new
        self.free_queue.prepend(new)

    @property
    def num_used_blocks(self) -> int:
        """Blocks some request holds (the null block aside)."""
        return len(self.blocks) - NUM_RESERVED_BLOCKS - len(self.free_queue)

    def shrink(self, keep: int) -> list[int]:
        """Cut the pool back to `keep` blocks, or to just past the highest block in use if that is more (ids
        never move, so a held block keeps every id below it). The blocks cut off are free; those still in
        the prefix cache are evicted. Returns the ids given back, lowest first (the runner's pools are cut
        to the new size)."""
        top = max((b.block_id for b in self.blocks if b.ref_cnt > 0), default=NULL_BLOCK_ID)
        stop = max(keep, top + 1, NUM_RESERVED_BLOCKS + 1)
        gone = self.blocks[stop:]
        for block in gone:
            self.free_queue.remove(block)
            if block.block_hash is not None:
                self._num_free_cached -= 1
                self._evict(block)
        del self.blocks[stop:]
        return [b.block_id for b in gone]

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take `n` blocks from the head of the free queue, evicting their cached contents."""
        self._grow_for(n)
        if n > len(self.free_queue):
            raise ValueError(f"asked for {n} blocks, only {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._num_free_cached -= 1
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None
        self.num_evictions += 1

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash)

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Publish a full, computed block. Returns False if another block already holds that hash."""
        if block.block_hash is not None or block_hash in self.cached:
            return False
        self._num_free_cached += block.ref_cnt == 0
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-cache hits; a hit on a free block pulls it out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                self._num_free_cached -= block.block_hash is not None
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; blocks that reach zero join the tail in the order given."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than it was taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)
                self._num_free_cached += block.block_hash is not None
