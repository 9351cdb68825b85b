"""One layer group's block tables: full attention, sliding window or recurrent state.

Every group draws from the shared block pool. Entries a request no longer needs become the null
block (the runner's table keeps its old ids; it never reads outside the window or past the state).
"""

from __future__ import annotations

from metalserve.kvcache.block_pool import BlockPool, KVBlock
from metalserve.kvcache.hashing import BlockHash
from metalserve.kvcache.specs import LayerGroupSpec, RecurrentState, SlidingWindow, group_key
from metalserve.request import Request


class FullAttentionGroup:
    """One block per `block_size` tokens; full, computed blocks are published to the prefix cache."""

    def __init__(self, group: int, pool: BlockPool, block_size: int, caching: bool) -> None:
        self.group, self.pool, self.block_size, self.caching = group, pool, block_size, caching
        self.tables: dict[str, list[KVBlock]] = {}
        self._num_published: dict[str, int] = {}  # leading entries already offered to the cache

    def _cached(self, block_hash: BlockHash) -> KVBlock | None:
        return self.pool.get_cached_block(group_key(block_hash, self.group))

    def longest_hit(self, hashes: list[BlockHash], max_blocks: int) -> int:
        """The most leading blocks (at most `max_blocks`) this group can take from the cache."""
        for i in range(max_blocks):
            if self._cached(hashes[i]) is None:
                return i
        return max_blocks

    def hit_entries(self, hashes: list[BlockHash], num_blocks: int) -> list[KVBlock]:
        return [self._cached(h) for h in hashes[:num_blocks]]  # type: ignore[misc]

    def release_skipped(self, request_id: str, num_computed: int) -> None:
        """Free the entries the next tokens no longer read (none for full attention)."""

    def release_unloaded(self, request_id: str, num_computed: int) -> None:
        """A connector's load ended short at `num_computed` tokens: give back the entries that only the
        lost part of the load needed (none for attention: the recompute writes into them)."""

    def num_new_blocks(self, table_len: int, num_tokens: int) -> int:
        return max(-(-num_tokens // self.block_size) - table_len, 0)

    def extend(self, table: list[KVBlock], num_tokens: int, new: list[KVBlock]) -> list[KVBlock]:
        """Append `new` (as many as num_new_blocks said) and return the appended entries."""
        table += new
        return new

    def publish(self, request: Request, num_computed: int, hashes: list[BlockHash]) -> None:
        table = self.tables.get(request.request_id)
        if not self.caching or table is None:
            return
        num_full = min(num_computed, request.num_tokens) // self.block_size
        start = self._num_published.get(request.request_id, 0)
        for i in range(start, num_full):
            block = table[i]
            if block is not self.pool.null_block and block.block_hash is None:
                self.pool.cache_block(block, group_key(hashes[i], self.group))
        self._num_published[request.request_id] = max(num_full, start)

    def fast_limit(self, request_id: str, num_computed: int) -> int:
        """Up to this many tokens, the next allocation has nothing to do in this group."""
        limit = len(self.tables[request_id]) * self.block_size
        if self.caching:
            limit = min(limit, (self._num_published.get(request_id, 0) + 1) * self.block_size)
        return limit

    def free(self, request_id: str) -> None:
        """Tail first, so the end of a sequence is evicted before its shared prefix."""
        table = self.tables.pop(request_id, [])
        self._num_published.pop(request_id, None)
        null = self.pool.null_block
        self.pool.free_blocks(b for b in reversed(table) if b is not null)

    def _drop(self, table: list[KVBlock], stop: int) -> None:
        """Replace entries [0, stop) with the null block, freeing the real ones (the newest first)."""
        null = self.pool.null_block
        dropped = [b for b in table[:stop] if b is not null]
        self.pool.free_blocks(reversed(dropped))
        table[:stop] = [null] * stop


class SlidingWindowGroup(FullAttentionGroup):
    """Full attention that frees the blocks behind every token's window."""

    def __init__(self, group: int, pool: BlockPool, block_size: int, caching: bool, window: int) -> None:
        super().__init__(group, pool, block_size, caching)
        self.window = window
        self._skipped: dict[str, int] = {}  # leading entries already replaced by the null block

    def first_needed(self, num_computed: int) -> int:
        """The first block the token at position `num_computed` reads."""
        return max(0, num_computed - self.window + 1) // self.block_size

    def longest_hit(self, hashes: list[BlockHash], max_blocks: int) -> int:
        """The largest end whose window blocks are all cached (the blocks before it need not be)."""
        end = max_blocks
        for i in range(max_blocks - 1, -1, -1):
            if self.first_needed(end * self.block_size) > i:
                return end
            if self._cached(hashes[i]) is None:
                end = i
        return end

    def hit_entries(self, hashes: list[BlockHash], num_blocks: int) -> list[KVBlock]:
        first = self.first_needed(num_blocks * self.block_size)
        return [self.pool.null_block] * first + super().hit_entries(hashes[first:], num_blocks - first)

    def release_skipped(self, request_id: str, num_computed: int) -> None:
        table = self.tables.get(request_id)
        first = min(self.first_needed(num_computed), len(table) if table is not None else 0)
        if table is None or first <= self._skipped.get(request_id, 0):
            return
        self._drop(table, first)
        self._skipped[request_id] = first

    def fast_limit(self, request_id: str, num_computed: int) -> int:
        # The next allocation must run once the window passes the next block.
        next_drop = (self._skipped.get(request_id, 0) + 1) * self.block_size + self.window - 1
        return min(super().fast_limit(request_id, num_computed), next_drop)

    def free(self, request_id: str) -> None:
        self._skipped.pop(request_id, None)
        super().free(request_id)


class RecurrentStateGroup(FullAttentionGroup):
    """One live state per request, in entry `(t - 1) // block_size` after `t` computed tokens.

    A step reads the state from the entry of its first token's predecessor and writes the entry of
    its last token, so at most two entries are real; the others are null. A state written exactly at
    a block boundary is a snapshot: published under that block's hash, then freed (cached) once the
    request moves on, so a later request with the same prefix resumes from it.
    """

    def longest_hit(self, hashes: list[BlockHash], max_blocks: int) -> int:
        for end in range(max_blocks, 0, -1):
            if self._cached(hashes[end - 1]) is not None:
                return end
        return 0

    def hit_entries(self, hashes: list[BlockHash], num_blocks: int) -> list[KVBlock]:
        if num_blocks == 0:
            return []
        return [self.pool.null_block] * (num_blocks - 1) + super().hit_entries(hashes[num_blocks - 1 :], 1)

    def release_skipped(self, request_id: str, num_computed: int) -> None:
        table = self.tables.get(request_id)
        if table is not None and num_computed > 0:
            self._drop(table, min((num_computed - 1) // self.block_size, len(table)))

    def release_unloaded(self, request_id: str, num_computed: int) -> None:
        """The table must end at the state of `num_computed` tokens, so the next step writes a new entry:
        the entry a lost snapshot was to load into goes back (and everything, from zero tokens)."""
        table = self.tables.get(request_id)
        keep = (num_computed - 1) // self.block_size + 1 if num_computed > 0 else 0
        if table is None or len(table) <= keep:
            return
        null = self.pool.null_block
        self.pool.free_blocks(reversed([b for b in table[keep:] if b is not null]))
        del table[keep:]

    def num_new_blocks(self, table_len: int, num_tokens: int) -> int:
        return 1 if -(-num_tokens // self.block_size) > table_len else 0

    def extend(self, table: list[KVBlock], num_tokens: int, new: list[KVBlock]) -> list[KVBlock]:
        if not new:
            return []
        gap = -(-num_tokens // self.block_size) - len(table) - 1
        appended = [self.pool.null_block] * gap + new
        table += appended
        return appended

    def publish(self, request: Request, num_computed: int, hashes: list[BlockHash]) -> None:
        """Only the state at exactly `num_computed` tokens exists: publish it if that is a boundary."""
        table = self.tables.get(request.request_id)
        bs = self.block_size
        if not self.caching or table is None or num_computed % bs or not num_computed:
            return
        k = num_computed // bs - 1
        block = table[k] if k < len(table) and k < len(hashes) else self.pool.null_block
        if block is not self.pool.null_block and block.block_hash is None:
            self.pool.cache_block(block, group_key(hashes[k], self.group))
        self._num_published[request.request_id] = k + 1

    def fast_limit(self, request_id: str, num_computed: int) -> int:
        table = self.tables[request_id]
        null = self.pool.null_block
        if any(b is not null for b in table[:-1]):
            return 0  # the read state of this step is freed by the next allocation
        return len(table) * self.block_size


def make_group(index: int, spec: LayerGroupSpec, pool: BlockPool, block_size: int, caching: bool) -> FullAttentionGroup:
    if isinstance(spec, SlidingWindow):
        return SlidingWindowGroup(index, pool, block_size, caching, spec.window)
    if isinstance(spec, RecurrentState):
        return RecurrentStateGroup(index, pool, block_size, caching)
    return FullAttentionGroup(index, pool, block_size, caching)
