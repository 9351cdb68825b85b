"""The hybrid KV cache manager: layer groups with their own specs and tables over one block pool.

A prefix hit must hold in every group at once, so its length is the fixed point of the groups'
longest hits (each only shrinks it). Admission counts the new real blocks of all groups together.
"""

from __future__ import annotations

from metalserve.kvcache.block_pool import KVBlock
from metalserve.kvcache.groups import FullAttentionGroup, make_group
from metalserve.kvcache.hashing import DEFAULT_HASH_ALGORITHM
from metalserve.kvcache.manager import ComputedBlocks, KVCacheManager
from metalserve.kvcache.sizing import blocks_for_request
from metalserve.kvcache.specs import FullAttention, LayerGroupSpec, RecurrentState, prefix_caching_problem
from metalserve.request import Request


class HybridComputedBlocks(ComputedBlocks):
    """A prefix hit with the entries of every group (`blocks` is group 0's)."""

    group_entries: list[list[KVBlock]]


class HybridKVCacheManager(KVCacheManager):
    """KVCacheManager's interface over several layer groups; `get_block_ids` and the ids returned
    by `allocate_slots` are group 0's, `last_group_ids` the other groups' appended ids."""

    def __init__(
        self,
        specs: list[LayerGroupSpec],
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        initial_blocks: int | None = None,
        hash_algorithm: str = DEFAULT_HASH_ALGORITHM,
    ) -> None:
        if not specs:
            raise ValueError("a KV cache needs at least one layer group")
        caching = enable_caching and prefix_caching_problem(specs) is None
        super().__init__(num_blocks, block_size, caching, initial_blocks, hash_algorithm)
        self.specs = list(specs)
        self.groups: list[FullAttentionGroup] = [
            make_group(i, spec, self.pool, block_size, caching) for i, spec in enumerate(specs)
        ]
        # Prefill chunks end on block boundaries so recurrent states land on them (snapshots).
        self.align_chunks = caching and any(isinstance(s, RecurrentState) for s in specs)
        self.last_group_ids: list[list[int]] = [[] for _ in specs[1:]]

    def blocks_for_request(self, num_tokens: int) -> int:
        """Every group's worst case together: a recurrent state holds at most two entries."""
        return blocks_for_request(self.specs, num_tokens, self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.groups[0].tables.get(request_id, ())]

    def get_group_block_ids(self, request_id: str) -> list[list[int]]:
        """The tables of groups 1.. (group 0's is get_block_ids)."""
        return [[b.block_id for b in g.tables.get(request_id, ())] for g in self.groups[1:]]

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        if not self.enable_caching:
            return ComputedBlocks([], 0)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_blocks)
        end = max_blocks
        while True:
            shrunk = end
            for group in self.groups:
                shrunk = group.longest_hit(hashes, shrunk)
            if shrunk == end:
                break
            end = shrunk
        entries = [g.hit_entries(hashes, end) for g in self.groups]
        hit = HybridComputedBlocks(entries[0], end * self.block_size)
        hit.group_entries = entries
        return hit

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: ComputedBlocks | None = None
    ) -> list[int] | None:
        """As KVCacheManager.allocate_slots, per group; entries no longer read are freed first."""
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be at least 1, got {num_new_tokens}")
        rid = request.request_id
        entries = getattr(new_computed_blocks, "group_entries", None) or [[] for _ in self.groups]
        hit_tokens = new_computed_blocks.num_tokens if new_computed_blocks is not None else 0
        num_computed = request.num_computed_tokens + hit_tokens
        total = num_computed + num_new_tokens
        self._publish(request, request.num_computed_tokens)  # before entries fall out of a window
        for group in self.groups:
            group.release_skipped(rid, num_computed)
        pairs = list(zip(self.groups, entries, strict=True))
        needed = [g.num_new_blocks(len(g.tables.get(rid, ())) + len(e), total) for g, e in pairs]
        hit_blocks = {id(b): b for e in entries for b in e if b is not self.pool.null_block}
        num_free_hits = sum(1 for b in hit_blocks.values() if b.ref_cnt == 0)
        if sum(needed) > self.pool.num_free_blocks - num_free_hits:
            return None
        appended = [self._extend(g, rid, e, total, n) for (g, e), n in zip(pairs, needed, strict=True)]
        if new_computed_blocks is not None and self.enable_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += hit_tokens
        self._publish(request, num_computed)
        self.fast_limit[rid] = min(g.fast_limit(rid, num_computed) for g in self.groups)
        self.last_group_ids = appended[1:]
        return appended[0]

    def _extend(self, group: FullAttentionGroup, rid: str, hit: list[KVBlock], total: int, n: int) -> list[int]:
        null = self.pool.null_block
        self.pool.touch(b for b in hit if b is not null)
        table = group.tables.setdefault(rid, [])
        table += hit
        appended = group.extend(table, total, self.pool.get_new_blocks(n))
        return [b.block_id for b in hit] + [b.block_id for b in appended]

    def _publish(self, request: Request, num_computed: int) -> None:
        """Offer the blocks (and boundary states) of the first `num_computed` tokens to the cache."""
        if self.enable_caching:
            num_full = min(num_computed, request.num_tokens) // self.block_size
            hashes = self._block_hashes(request, num_full)
            for group in self.groups:
                group.publish(request, num_computed, hashes)

    def free(self, request: Request) -> None:
        """Publish what the request computed, then release every group's blocks (each tail first)."""
        if request.request_id not in self.groups[0].tables:
            return
        self._publish(request, request.num_computed_tokens)
        for group in self.groups:
            group.free(request.request_id)
        self.fast_limit.pop(request.request_id, None)


def make_kv_manager(
    specs: list[LayerGroupSpec] | None,
    num_blocks: int,
    block_size: int,
    enable_caching: bool = True,
    initial_blocks: int | None = None,
) -> KVCacheManager:
    """The plain manager for one full-attention group (most models: less to track per step), the
    hybrid one otherwise."""
    if specs is None or (len(specs) == 1 and isinstance(specs[0], FullAttention)):
        return KVCacheManager(num_blocks, block_size, enable_caching, initial_blocks)
    return HybridKVCacheManager(specs, num_blocks, block_size, enable_caching, initial_blocks)
