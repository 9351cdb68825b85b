"""Requests whose prefix blocks load from a KV connector wait outside the batch (vLLM's
WAITING_FOR_REMOTE_KVS), as a request whose grammar compiles does: they hold their blocks, not the queue.

Admission allocates fresh blocks for the connector's tokens and parks the request here; when the worker
reports its loads finished, the request goes back to the head of the waiting queue with
`num_computed_tokens` after its last intact block, and is then admitted without a new prefix lookup.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from metalserve.kvcache.connector.base import ConnectorMetadata, ConnectorOutput, KVConnectorScheduler
from metalserve.kvcache.manager import ComputedBlocks, KVCacheManager
from metalserve.request import Request, RequestStatus


class KVLoads:
    """The connector and the requests it is loading for."""

    def __init__(self, connector: KVConnectorScheduler, kv: KVCacheManager, block_size: int) -> None:
        self.connector = connector
        self.kv = kv
        self.block_size = block_size
        self.loading: dict[str, Request] = {}  # parked until their loads finish
        self.loaded: set[str] = set()  # back in the waiting queue, holding their loaded blocks
        self._orphans: dict[str, Request] = {}  # finished while loading: freed once the loads end
        self._released: set[str] = set()  # gave their loaded blocks back: admitted without the connector

    def start_loading(self, request: Request, hit: ComputedBlocks) -> bool:
        """Ask the connector for tokens past the RAM hit; if it has some, allocate their blocks and park
        the request (True). False: nothing external (or no room): admit as usual."""
        if request.request_id in self._released:
            self._released.discard(request.request_id)
            return False
        if request.sampling_params.prompt_logprobs is not None:
            return False  # as the RAM prefix cache: its prompt is computed whole, its logits are needed
        external = self.connector.get_num_new_matched_tokens(request, hit.num_tokens)
        if external <= 0:
            return False
        new_ids = self.kv.allocate_slots(request, external, hit)
        if new_ids is None:
            self.connector.update_state_after_alloc(request, self.kv.empty_block_ids(), 0)
            return False
        self.connector.update_state_after_alloc(request, self.kv.get_block_ids(request.request_id), external)
        request.num_computed_tokens = hit.num_tokens
        if request.num_cached_tokens is None:
            request.num_cached_tokens = hit.num_tokens  # the loaded tokens are added when they arrive
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.loading[request.request_id] = request
        return True

    def finish(self, output: ConnectorOutput, requeue: Callable[[Request], None]) -> None:
        """Apply the worker's report: finished requests go back to the waiting queue via `requeue`."""
        for rid, num_intact in output.finished_loads.items():
            orphan = self._orphans.pop(rid, None)
            if orphan is not None:
                self.kv.free(orphan)
                continue
            request = self.loading.pop(rid, None)
            if request is None:
                continue
            request.num_computed_tokens += self.connector.num_loaded_tokens(request, num_intact)
            # Window groups got blocks for every position, but only those in the window of the prefix end
            # were loaded: the others go back now, before anything publishes them with stale pages. A state
            # group keeps only the state it resumes from (a snapshot lost in the load gives its entry back).
            self.kv.release_skipped(request, request.num_computed_tokens)
            request.num_cached_tokens = request.num_computed_tokens
            request.status = RequestStatus.WAITING
            self.loaded.add(rid)
            requeue(request)
        self.connector.update_connector_output(output)

    def release_loaded(self, waiting: Iterable[Request]) -> None:
        """Admission is stuck: loaded requests that wait holding blocks could block each other for good.
        Give their blocks back (the pages stay in the RAM prefix cache, published by `free`) and let them
        be admitted like any request, from a RAM hit, without asking the connector again."""
        for request in list(waiting):
            if request.request_id in self.loaded:
                self.loaded.discard(request.request_id)
                self.kv.free(request)
                request.num_computed_tokens = 0
                self._released.add(request.request_id)

    def finished_while_loading(self, request: Request) -> bool:
        """A request that finishes (aborted) while loading keeps its blocks until the loads end: the
        worker may still write into them. True when it was loading (do not free its blocks now)."""
        self.connector.request_finished(request)
        self.loaded.discard(request.request_id)
        self._released.discard(request.request_id)
        if self.loading.pop(request.request_id, None) is None:
            return False
        self._orphans[request.request_id] = request
        return True

    @property
    def busy(self) -> bool:
        return bool(self.loading or self._orphans)

    @property
    def num_parked(self) -> int:
        return len(self.loading) + len(self._orphans)

    def metadata(self, scheduled: dict[str, int], requests: dict[str, Request]) -> ConnectorMetadata:
        return self.connector.build_connector_meta(scheduled, requests, self.kv.get_block_ids)
