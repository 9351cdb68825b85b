"""The KV cache manager: per-request block tables on top of the block pool, with prefix caching."""

from __future__ import annotations

from typing import NamedTuple

from metalserve.kvcache.block_pool import BlockPool, KVBlock
from metalserve.kvcache.hashing import DEFAULT_HASH_ALGORITHM, BlockHash, block_extra_keys, hash_block_tokens
from metalserve.request import Request


class ComputedBlocks(NamedTuple):
    """Prefix-cache hit for a request: leading cached blocks and the number of tokens they cover."""

    blocks: list[KVBlock]
    num_tokens: int

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]


_NO_HIT = ComputedBlocks([], 0)


class KVCacheManager:
    """Hands out blocks to requests and reuses cached full blocks found by the hash chain.

    A block is published to the prefix cache only once its KV has been written (its tokens are below
    `request.num_computed_tokens` at the next allocation, or when the request is freed), so a hit never
    reads KV that the current step is still computing.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        initial_blocks: int | None = None,
        hash_algorithm: str = DEFAULT_HASH_ALGORITHM,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_algorithm = hash_algorithm
        self.pool = BlockPool(num_blocks, enable_caching, initial_blocks)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        # How many leading blocks of each request were already offered to the cache.
        self._num_cached_blocks: dict[str, int] = {}
        # Per request: the token count it may reach before allocate_slots has work to do again.
        self.fast_limit: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_for_request(self, num_tokens: int) -> int:
        """The most blocks one request of `num_tokens` tokens can hold at once."""
        return -(-num_tokens // self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def hash_prompt(self, request: Request) -> None:
        """Hash the request's full blocks now, at admission: content that cannot be hashed (a salt that is
        not valid Unicode) fails this one request here instead of a step that serves everyone."""
        if self.enable_caching:
            self._block_hashes(request, request.num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The longest cached prefix of full blocks, leaving at least the last token to recompute.

        The last token is always recomputed so a fully cached prompt still produces logits.
        """
        if not self.enable_caching:
            return _NO_HIT
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_blocks)
        hits: list[KVBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return ComputedBlocks(hits, len(hits) * self.block_size)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: ComputedBlocks | None = None
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens; None (and no change) if the pool cannot.

        `new_computed_blocks` is the prefix hit of a request being admitted; its blocks are appended
        first and the prefix-cache statistics are counted when the allocation succeeds.
        Returns the ids of the blocks appended to the request's table.
        """
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be at least 1, got {num_new_tokens}")
        if (
            new_computed_blocks is None
            and request.num_computed_tokens + num_new_tokens <= self.fast_limit.get(request.request_id, 0)
        ):
            return []  # the decode fast path: nothing to allocate or publish
        hit = new_computed_blocks if new_computed_blocks is not None else _NO_HIT
        blocks = self.req_to_blocks.get(request.request_id)
        num_held = len(blocks) if blocks is not None else 0
        num_computed = request.num_computed_tokens + hit.num_tokens
        num_needed = -(-(num_computed + num_new_tokens) // self.block_size) - num_held - len(hit.blocks)
        if num_needed <= 0 and not hit.blocks and blocks is not None:
            self._cache_full_blocks(request, blocks, request.num_computed_tokens)
            self._update_fast_limit(request.request_id, blocks)
            return []
        # Hit blocks that are free would leave the free queue when taken, so they do not count as room.
        num_free_hits = sum(1 for b in hit.blocks if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_free_hits:
            return None
        self.pool.touch(hit.blocks)
        new_blocks = self.pool.get_new_blocks(max(num_needed, 0))
        if blocks is None:
            blocks = self.req_to_blocks[request.request_id] = []
        blocks += hit.blocks
        blocks += new_blocks
        if new_computed_blocks is not None and self.enable_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += hit.num_tokens
        self._cache_full_blocks(request, blocks, num_computed)
        self._update_fast_limit(request.request_id, blocks)
        return [b.block_id for b in hit.blocks] + [b.block_id for b in new_blocks]

    def _update_fast_limit(self, request_id: str, blocks: list[KVBlock]) -> None:
        """Up to this many tokens, allocate_slots has nothing to do: the blocks hold them and the next
        block to publish is not yet full."""
        limit = len(blocks) * self.block_size
        if self.enable_caching:
            limit = min(limit, (self._num_cached_blocks.get(request_id, 0) + 1) * self.block_size)
        self.fast_limit[request_id] = limit

    def free(self, request: Request) -> None:
        """Release a request's blocks, publishing its computed full blocks first.

        Blocks are freed tail first, so the end of a sequence is evicted before its shared prefix.
        """
        blocks = self.req_to_blocks.pop(request.request_id, None)
        if blocks is None:
            return
        self._cache_full_blocks(request, blocks, request.num_computed_tokens)
        self._num_cached_blocks.pop(request.request_id, None)
        self.fast_limit.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_computed: int) -> None:
        if not self.enable_caching:
            return
        num_full = min(num_computed, request.num_tokens) // self.block_size
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        for i in range(start, num_full):
            if blocks[i].block_hash is None:
                self.pool.cache_block(blocks[i], hashes[i])
        self._num_cached_blocks[request.request_id] = num_full

    def _block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """Extend the request's hash chain to cover its first `num_blocks` full blocks."""
        hashes = request.block_hashes
        bs = self.block_size
        if num_blocks * bs > request.num_tokens:
            raise ValueError(f"request {request.request_id} has no {num_blocks} full blocks to hash")
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            tokens = request.token_ids_between(i * bs, (i + 1) * bs)
            images = request.mm_hashes_between(i * bs, (i + 1) * bs)  # an image's pixels key its blocks
            extra = block_extra_keys(i, request.cache_salt, mm_hashes=images)
            hashes.append(hash_block_tokens(parent, tokens, extra, self.hash_algorithm))
        return hashes
