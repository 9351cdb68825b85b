"""The disk connector's scheduler half: prefix blocks past the RAM hit that the store holds, and the
computed full blocks of each step to write through to it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from metalserve.kvcache.connector.base import (
    BlockTransfer,
    ConnectorMetadata,
    ConnectorOutput,
    ConnectorStats,
    KVConnectorScheduler,
)
from metalserve.kvcache.connector.keys import StoreNamespace
from metalserve.kvcache.hashing import BlockHash
from metalserve.request import Request


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


# The KV manager's hash chain of a request's first n full blocks (KVCacheManager.chain_hashes).
ChainHashes = Callable[[Request, int], list[BlockHash]]


class DiskConnectorScheduler(KVConnectorScheduler):
    """Every computed full block is written through to the store (so a block the RAM cache evicts is
    already on disk); an admitted request whose prefix continues on disk loads those blocks first."""

    def __init__(self, store: BlockIndex, namespace: StoreNamespace, chain_hashes: ChainHashes) -> None:
        self.store = store
        self.namespace = namespace
        self.block_size = namespace.block_size
        self._chain_hashes = chain_hashes
        self._loads: dict[str, list[BlockTransfer]] = {}  # allocated, not yet sent to the worker
        self._load_keys: dict[str, list[str]] = {}  # matched keys of a request being admitted
        self._queried: set[str] = set()  # requests counted in `queries` (a retried admission counts once)
        self.queries = 0
        self.hits = 0

    def _key(self, request: Request, block_hash: BlockHash) -> str:
        return self.namespace.key(block_hash, request.cache_salt)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs  # the last token is always computed
        first = num_computed_tokens // bs
        if first >= max_blocks:
            return 0
        hashes = self._chain_hashes(request, max_blocks)
        keys: list[str] = []
        for block_hash in hashes[first:max_blocks]:
            key = self._key(request, block_hash)
            if not self.store.contains(key):
                break
            keys.append(key)
        if request.request_id not in self._queried:
            self._queried.add(request.request_id)
            self.queries += request.num_tokens - num_computed_tokens
        self._load_keys[request.request_id] = keys
        return len(keys) * bs

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        keys = self._load_keys.pop(request.request_id, [])
        n = num_external_tokens // self.block_size
        if n > len(keys) or len(block_ids) < n:
            raise ValueError(
                f"request {request.request_id}: {n} blocks to load, {len(keys)} matched, {len(block_ids)} allocated"
            )
        if n:
            self._loads[request.request_id] = [
                BlockTransfer(b, k) for b, k in zip(block_ids[:n], keys[:n], strict=True)
            ]

    def build_connector_meta(
        self, scheduled: dict[str, int], requests: dict[str, Request], block_ids: Callable[[str], list[int]]
    ) -> ConnectorMetadata:
        meta = ConnectorMetadata(loads=self._loads)
        self._loads = {}
        if not self.store.writable:
            return meta
        bs = self.block_size
        for rid, n in scheduled.items():
            request = requests[rid]
            after = min(request.num_computed_tokens, request.num_tokens) // bs
            before = (request.num_computed_tokens - n) // bs
            if after <= before:
                continue
            hashes = self._chain_hashes(request, after)
            table = block_ids(rid)
            for i in range(before, after):
                key = self._key(request, hashes[i])
                if not self.store.has_or_pending(key):
                    self.store.mark_pending(key)
                    meta.saves.append(BlockTransfer(table[i], key))
        return meta

    def update_connector_output(self, output: ConnectorOutput) -> None:
        self.hits += sum(output.finished_loads.values()) * self.block_size

    def request_finished(self, request: Request) -> None:
        self._load_keys.pop(request.request_id, None)
        self._queried.discard(request.request_id)

    def stats(self) -> ConnectorStats:
        s = self.store
        return ConnectorStats(
            self.queries, self.hits, s.bytes_loaded, s.bytes_saved, s.load_seconds, s.usage_bytes, s.capacity_bytes
        )
