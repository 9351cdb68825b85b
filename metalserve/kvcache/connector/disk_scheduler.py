"""The disk connector's scheduler half: prefix blocks past the RAM hit that the store holds, and the
computed full blocks of each step to write through to it. Its worker half, which moves the pages, is
metalserve/executor/connector/disk_worker.py; the store is disk_store.py here."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Final, Literal, Protocol

from metalserve.kvcache.block_pool import NULL_BLOCK_ID
from metalserve.kvcache.connector.base import (
    BlockTransfer,
    ConnectorMetadata,
    ConnectorStats,
    KVConnectorScheduler,
)
from metalserve.kvcache.connector.disk_keys import StoreNamespace
from metalserve.kvcache.hashing import BlockHash
from metalserve.kvcache.specs import LayerGroupSpec, RecurrentState, SlidingWindow
from metalserve.request import Request

BlockIds = tuple[list[int], ...]  # one list per layer group (KVCacheManager.get_block_ids)

# What a layer group needs of a prefix, as `windows[g]`: None (full attention: every block), a sliding window
# in tokens (the blocks it covers), or RECURRENT_STATE (the state snapshot at the prefix's last block).
RECURRENT_STATE: Final = "state"
GroupNeed = int | Literal["state"] | None


def group_needs(specs: Sequence[LayerGroupSpec]) -> list[GroupNeed]:
    """What each layer group needs of a prefix (the connector's `windows`)."""
    needs: list[GroupNeed] = []
    for spec in specs:
        if isinstance(spec, SlidingWindow):
            needs.append(spec.window)
        else:
            needs.append(RECURRENT_STATE if isinstance(spec, RecurrentState) else None)
    return needs


class BlockIndex(Protocol):
    """What the scheduler half asks of the store (store.DiskStore; an in-memory fake in tests)."""

    writable: bool
    bytes_loaded: int
    bytes_saved: int
    load_seconds: float
    usage_bytes: int
    capacity_bytes: int

    def contains(self, key: str) -> bool: ...

    def has_or_pending(self, key: str) -> bool: ...

    def mark_pending(self, key: str) -> None: ...


@dataclass(frozen=True)
class _LoadPlan:
    first: int  # blocks of the RAM hit
    end: int  # blocks of the prefix after the loads
    needed: list[tuple[int, int]]  # (block index, group), in the order of the transfers
    hashes: list[BlockHash]


# The KV manager's hash chain of a request's first n full blocks (KVCacheManager.chain_hashes).
ChainHashes = Callable[[Request, int], list[BlockHash]]


class DiskConnectorScheduler(KVConnectorScheduler):
    """Every computed full block is written through to the store (so a block the RAM cache evicts is
    already on disk); an admitted request whose prefix continues on disk loads those blocks first.

    Each layer group has its own keys (the group index is in the namespace). `windows[g]` is group g's
    sliding window in tokens (None: full attention; RECURRENT_STATE: a recurrent-state group): a window
    group needs only the blocks the window of the prefix end covers, a state group only the snapshot of
    the prefix's last block (a state saved under a block's key is the state after that block's last
    token), so the loadable prefix is the longest one for which every group has what it needs."""

    def __init__(
        self,
        store: BlockIndex,
        namespace: StoreNamespace,
        chain_hashes: ChainHashes,
        windows: Sequence[GroupNeed] = (None,),
        null_block_id: int = NULL_BLOCK_ID,
    ) -> None:
        self.store = store
        self.namespaces = [replace(namespace, layer_group=g) for g in range(len(windows))]
        self.windows = list(windows)
        self.block_size = namespace.block_size
        self.null_block_id = null_block_id
        self._chain_hashes = chain_hashes
        self._loads: dict[str, list[BlockTransfer]] = {}  # allocated, not yet sent to the worker
        self._plans: dict[str, _LoadPlan] = {}  # matched or loading: what each transfer stands for
        self._queried: set[str] = set()  # requests counted in `queries` (a retried admission counts once)
        self._offered: dict[str, int] = {}  # request -> its blocks offered for saving so far
        self.queries = 0
        self.hits = 0

    @property
    def namespace(self) -> StoreNamespace:
        return self.namespaces[0]

    def check_groups(self, specs: Sequence[LayerGroupSpec]) -> None:
        for i, spec in enumerate(specs):
            if isinstance(spec, RecurrentState) and not spec.snapshots:
                raise ValueError(f"layer group {i} keeps a recurrent state without snapshots: nothing to store")
        if group_needs(specs) != self.windows:
            raise ValueError(f"a disk connector for groups {self.windows} cannot serve groups {group_needs(specs)}")

    def _key(self, request: Request, block_hash: BlockHash, group: int = 0) -> str:
        return self.namespaces[group].key(block_hash, request.cache_salt)

    def _first_needed(self, group: int, end: int) -> int:
        """The first block group `group` needs for a prefix of `end` blocks (0 for full attention)."""
        window = self.windows[group]
        if window is None:
            return 0
        if isinstance(window, str):  # RECURRENT_STATE
            return max(0, end - 1)
        return max(0, end * self.block_size - window + 1) // self.block_size

    def _needed(self, first: int, end: int) -> list[tuple[int, int]]:
        """(block index, group) pairs past the RAM hit (`first` blocks) a prefix of `end` blocks needs, in
        block order: the worker's report of leading intact transfers maps back onto a prefix."""
        return sorted(
            (i, g) for g in range(len(self.windows)) for i in range(max(first, self._first_needed(g, end)), end)
        )

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs  # the last token is always computed
        first = num_computed_tokens // bs
        self._plans.pop(request.request_id, None)
        if first >= max_blocks:
            return 0
        if request.request_id not in self._queried:
            self._queried.add(request.request_id)
            self.queries += request.num_tokens - num_computed_tokens
        hashes = self._chain_hashes(request, max_blocks)
        end = self._longest_end(first, max_blocks, lambda i, g: self.store.contains(self._key(request, hashes[i], g)))
        if end == first:
            return 0
        self._plans[request.request_id] = _LoadPlan(first, end, self._needed(first, end), hashes[:end])
        return (end - first) * bs

    def _longest_end(self, first: int, last: int, has: Callable[[int, int], bool]) -> int:
        """The longest prefix end in [first, last] (blocks) for which every group has (`has(block, group)`)
        what it needs past the RAM hit of `first` blocks; `first` when none. Linear in the blocks: full
        groups need a run from `first`, window and state groups are checked by running counts of their misses."""
        end = last
        for g, window in enumerate(self.windows):
            if window is None:
                i = first
                while i < end and has(i, g):
                    i += 1
                end = i
        misses: dict[int, list[int]] = {}  # window/state group -> misses among blocks first..first+k-1, per k
        for g, window in enumerate(self.windows):
            if window is not None:
                counts = [0]
                for i in range(first, end):
                    counts.append(counts[-1] + (not has(i, g)))
                misses[g] = counts
        for e in range(end, first, -1):
            if all(m[e - first] == m[max(first, self._first_needed(g, e)) - first] for g, m in misses.items()):
                return e
        return first

    def update_state_after_alloc(self, request: Request, block_ids: BlockIds, num_external_tokens: int) -> None:
        plan = self._plans.get(request.request_id)
        if num_external_tokens == 0:
            self._plans.pop(request.request_id, None)
            return
        if plan is None or (plan.end - plan.first) * self.block_size != num_external_tokens:
            raise ValueError(f"request {request.request_id}: {num_external_tokens} external tokens were not matched")
        transfers = []
        for i, g in plan.needed:
            if i >= len(block_ids[g]) or block_ids[g][i] == self.null_block_id:
                raise ValueError(f"request {request.request_id}: no block {i} of group {g} to load into")
            transfers.append(BlockTransfer(block_ids[g][i], self._key(request, plan.hashes[i], g), g))
        self._loads[request.request_id] = transfers

    def num_loaded_tokens(self, request: Request, num_intact: int) -> int:
        """The longest prefix past the RAM hit that the leading `num_intact` transfers complete."""
        plan = self._plans.pop(request.request_id, None)
        if plan is None:
            return 0
        intact = set(plan.needed[:num_intact])
        end = self._longest_end(plan.first, plan.end, lambda i, g: (i, g) in intact)
        self.hits += (end - plan.first) * self.block_size
        return (end - plan.first) * self.block_size

    def build_connector_meta(
        self, scheduled: dict[str, int], requests: dict[str, Request], block_ids: Callable[[str], BlockIds]
    ) -> ConnectorMetadata:
        meta = ConnectorMetadata(loads=self._loads)
        self._loads = {}
        if not self.store.writable:
            return meta
        bs = self.block_size
        for rid, n in scheduled.items():
            request = requests[rid]
            after = min(request.num_computed_tokens, request.num_tokens) // bs
            # Under async scheduling a block completed by a token still being sampled (a placeholder)
            # cannot be keyed in its own step: it is offered with the next one, whose saves are read out
            # after that step's forward, so after the one that computed the block.
            start = (request.num_computed_tokens - n) // bs
            before = min(start, self._offered.get(rid, start))
            self._offered[rid] = after
            if after <= before:
                continue
            hashes = self._chain_hashes(request, after)
            tables = block_ids(rid)
            # A state group's snapshots: the state after the step's last token, if that ends a block, and
            # the state the step reads, if that is at a block boundary (a block offered late, above: this
            # step reads that entry and writes another, so it still holds the snapshot after the forward).
            snapshots = {after - 1} if request.num_computed_tokens == after * bs else set()
            if request.num_computed_tokens - n == start * bs:
                snapshots.add(start - 1)
            for i in range(before, after):
                for g, table in enumerate(tables):
                    if i >= len(table) or table[i] == self.null_block_id:
                        continue  # behind a window: this group no longer holds the block
                    if self.windows[g] == RECURRENT_STATE and i not in snapshots:
                        continue  # the entry holds the state of another position
                    key = self._key(request, hashes[i], g)
                    if not self.store.has_or_pending(key):
                        self.store.mark_pending(key)
                        meta.saves.append(BlockTransfer(table[i], key, g))
        return meta

    def request_finished(self, request: Request) -> None:
        self._plans.pop(request.request_id, None)
        self._offered.pop(request.request_id, None)
        self._queried.discard(request.request_id)

    def stats(self) -> ConnectorStats:
        s = self.store
        return ConnectorStats(
            self.queries, self.hits, s.bytes_loaded, s.bytes_saved, s.load_seconds, s.usage_bytes, s.capacity_bytes
        )
