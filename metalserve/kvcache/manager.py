"""The KV cache manager: per-request block tables of every layer group over one block pool, with prefix caching.

One manager serves every model: a model of full attention is the one-group case. Each group (full
attention, a sliding window, a recurrent state: groups.py) keeps its own table per request, all drawn
from the shared pool. Block ids leave the manager as one value, `BlockIds` (vLLM's KVCacheBlocks):
a tuple with one list per group, which the scheduler and the runner pass on unchanged.

A prefix hit must hold in every group at once, so its length is the fixed point of the groups'
longest hits (each only shrinks it). Admission counts the new real blocks of all groups together.
A block is published to the prefix cache only once its KV has been written (its tokens are below
`request.num_computed_tokens` at the next allocation, or when the request is freed), so a hit never
reads KV that the current step is still computing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from metalserve.kvcache.block_pool import BlockPool, KVBlock
from metalserve.kvcache.groups import FullAttentionGroup, make_group
from metalserve.kvcache.hashing import DEFAULT_HASH_ALGORITHM, BlockHash, block_extra_keys, hash_block_tokens
from metalserve.kvcache.plan import blocks_for_request
from metalserve.kvcache.specs import FullAttention, LayerGroupSpec, RecurrentState, prefix_caching_problem
from metalserve.request import Request

BlockIds = tuple[list[int], ...]  # one list of block ids per layer group


class ComputedBlocks(NamedTuple):
    """A prefix-cache hit: each group's leading entries, and the number of tokens they cover."""

    blocks: tuple[list[KVBlock], ...]
    num_tokens: int

    @property
    def block_ids(self) -> BlockIds:
        return tuple([b.block_id for b in group] for group in self.blocks)


class KVCacheManager:
    """Hands out blocks to requests, per layer group, and reuses cached blocks found by the hash chain."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        initial_blocks: int | None = None,
        hash_algorithm: str = DEFAULT_HASH_ALGORITHM,
        groups: Sequence[LayerGroupSpec] | None = None,
    ) -> None:
        """`groups`: the model's layer groups (kvcache/specs.py); None: one full-attention group."""
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        specs: list[LayerGroupSpec] = list(groups) if groups is not None else [FullAttention()]
        if not specs:
            raise ValueError("a KV cache needs at least one layer group")
        self.block_size = block_size
        self.enable_caching = enable_caching and prefix_caching_problem(specs) is None
        self.hash_algorithm = hash_algorithm
        self.pool = BlockPool(num_blocks, self.enable_caching, initial_blocks)
        self.specs = specs
        self.groups: list[FullAttentionGroup] = [
            make_group(i, spec, self.pool, block_size, self.enable_caching) for i, spec in enumerate(specs)
        ]
        # Prefill chunks end on block boundaries so recurrent states land on them (snapshots).
        self.align_chunks = self.enable_caching and any(isinstance(s, RecurrentState) for s in specs)
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
        """The most block ids one request of `num_tokens` tokens can hold at once, over every group."""
        return blocks_for_request(self.specs, num_tokens, self.block_size)

    def get_block_ids(self, request_id: str) -> BlockIds:
        """The request's table in every group."""
        return tuple([b.block_id for b in g.tables.get(request_id, ())] for g in self.groups)

    def empty_block_ids(self) -> BlockIds:
        """Nothing new in any group (a step that allocates nothing)."""
        return tuple([] for _ in self.groups)

    def hash_prompt(self, request: Request) -> None:
        """Hash the request's full blocks now, at admission: content that cannot be hashed (a salt that is
        not valid Unicode) fails this one request here instead of a step that serves everyone."""
        if self.enable_caching:
            self._block_hashes(request, request.num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The longest cached prefix of full blocks in every group, leaving at least the last token to
        recompute (so a fully cached prompt still produces logits). A request that asks for its prompt's
        logprobs computes the whole prompt: its logits are needed; so does a mean or CLS pooling request
        (every row's hidden state, or the first's)."""
        params = request.sampling_params
        whole = params.prompt_logprobs is not None or (params.pooling is not None and not params.pooling.reuses_prefix)
        if not self.enable_caching or whole:
            return ComputedBlocks(tuple([] for _ in self.groups), 0)
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
        return ComputedBlocks(tuple(g.hit_entries(hashes, end) for g in self.groups), end * self.block_size)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: ComputedBlocks | None = None
    ) -> BlockIds | None:
        """Make room for `num_new_tokens` more tokens; None (and no change) if the pool cannot.

        `new_computed_blocks` is the prefix hit of a request being admitted; its entries are appended
        first and the prefix-cache statistics are counted when the allocation succeeds. Entries the
        next tokens no longer read (behind a window, an old state) are freed first.
        Returns the ids appended to each group's table.
        """
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be at least 1, got {num_new_tokens}")
        rid = request.request_id
        if new_computed_blocks is None and request.num_computed_tokens + num_new_tokens <= self.fast_limit.get(rid, 0):
            return self.empty_block_ids()  # the decode fast path: nothing to allocate or publish
        hit = new_computed_blocks or ComputedBlocks(tuple([] for _ in self.groups), 0)
        num_computed = request.num_computed_tokens + hit.num_tokens
        total = num_computed + num_new_tokens
        self._publish(request, request.num_computed_tokens)  # before entries fall out of a window
        for group in self.groups:
            group.release_skipped(rid, num_computed)
        pairs = list(zip(self.groups, hit.blocks, strict=True))
        needed = [g.num_new_blocks(len(g.tables.get(rid, ())) + len(e), total) for g, e in pairs]
        # Hit blocks that are free leave the free queue when taken, so they do not count as room.
        hit_blocks = {id(b): b for e in hit.blocks for b in e if b is not self.pool.null_block}
        num_free_hits = sum(1 for b in hit_blocks.values() if b.ref_cnt == 0)
        if sum(needed) > self.pool.num_free_blocks - num_free_hits:
            return None
        appended = tuple(self._extend(g, rid, e, total, n) for (g, e), n in zip(pairs, needed, strict=True))
        if new_computed_blocks is not None and self.enable_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += hit.num_tokens
        self._publish(request, num_computed)
        self.fast_limit[rid] = min(g.fast_limit(rid, num_computed) for g in self.groups)
        return appended

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
        """Publish what the request computed, then release every group's blocks (each tail first, so the
        end of a sequence is evicted before its shared prefix)."""
        if request.request_id not in self.groups[0].tables:
            return
        self._publish(request, request.num_computed_tokens)
        for group in self.groups:
            group.free(request.request_id)
        self.fast_limit.pop(request.request_id, None)

    def release_skipped(self, request: Request, num_computed: int) -> None:
        """After a connector's load: give back the entries no group reads once `num_computed` tokens are
        computed (behind a window, a state before the last), and those a load that ended short left
        unused (a state entry past the state of `num_computed` tokens)."""
        for group in self.groups:
            group.release_skipped(request.request_id, num_computed)
            group.release_unloaded(request.request_id, num_computed)
        self.fast_limit.pop(request.request_id, None)  # the tables changed: the next allocation looks again

    def chain_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The hash chain of the request's first `num_blocks` full blocks (the KV connector's keys)."""
        return self._block_hashes(request, num_blocks)[:num_blocks]

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
            adapter = (
                request.lora.cache_key if request.lora is not None else None
            )  # an adapter (and scale) keys every block
            extra = block_extra_keys(i, request.cache_salt, adapter, mm_hashes=images)
            hashes.append(hash_block_tokens(parent, tokens, extra, self.hash_algorithm))
        return hashes
