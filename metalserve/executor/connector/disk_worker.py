"""The disk connector's worker half: reads on reader threads, writes on a writer thread, and every touch
of an MLX array on the engine thread. Its scheduler half, which picks the blocks, is
metalserve/kvcache/connector/disk_scheduler.py (the store beside it: disk_store.py).

A save copies the block's pages to host memory right after the forward (so the block may be freed or
reused at once), then a writer thread encodes and writes the file. A load reads and checks files on
reader threads; the engine thread puts a request's blocks into the pools once all of them arrived.
When the disk falls behind, saves beyond `max_pending_bytes` are dropped (logged): recompute, not a stall.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from metalserve.executor.connector.base import KVConnectorWorker
from metalserve.executor.connector.pages import HostBlock, dtype_tag, expected_shapes, read_blocks, write_blocks
from metalserve.executor.connector.states import read_states, state_dtype_tag, state_shapes, write_states
from metalserve.executor.state_cache import RecurrentStates
from metalserve.kvcache.connector.base import BlockTransfer, ConnectorMetadata, ConnectorOutput
from metalserve.kvcache.connector.disk_store import DiskStore

logger = logging.getLogger("metalserve.kv_disk")

DEFAULT_MAX_PENDING_BYTES = 512 * 1024**2
READ_THREADS = 2


@dataclass
class _Load:
    transfers: list[BlockTransfer]
    futures: list[Future[dict[str, np.ndarray] | None]]


class DiskConnectorWorker(KVConnectorWorker):
    """`states`: the runner's recurrent states (hybrid models): a transfer of their group moves the state
    snapshot in that block id's slot instead of KV pages."""

    def __init__(
        self,
        store: DiskStore,
        block_size: int,
        states: RecurrentStates | None = None,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
    ) -> None:
        self.store = store
        self.block_size = block_size
        self.states = states
        self.max_pending_bytes = max_pending_bytes
        self._loads: dict[str, _Load] = {}
        self._finished: dict[str, int] = {}
        self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kv-disk-read")
        self._writes: queue.Queue[tuple[str, HostBlock, dict[str, str]] | None] = queue.Queue()
        self._pending_bytes = 0
        self._pending_lock = threading.Condition()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-write", daemon=True)
        self._writer.start()

    # ---- loads ----

    def start_load_kv(self, meta: ConnectorMetadata | None, caches: Sequence[Any]) -> None:
        if meta is not None:
            for rid, transfers in meta.loads.items():
                futures = [self._readers.submit(self.store.read, t.key) for t in transfers]
                self._loads[rid] = _Load(transfers, futures)
        done = [rid for rid, load in self._loads.items() if all(f.done() for f in load.futures)]
        for rid in done:
            self._finished[rid] = self._install(self._loads.pop(rid), caches)

    def _is_state(self, transfer: BlockTransfer) -> bool:
        return self.states is not None and transfer.group == self.states.group

    def _kind(self, transfer: BlockTransfer) -> int:
        """The transfer's index into `_format`: 0 KV pages, 1 a state snapshot."""
        return 1 if self._is_state(transfer) else 0

    def _format(self, caches: Sequence[Any]) -> tuple[tuple[dict[str, tuple[int, ...]], str], ...]:
        """(shapes, dtype tag) of a stored KV block, then of a state snapshot (hybrid models)."""
        kv = (expected_shapes(caches, self.block_size), dtype_tag(caches))
        if self.states is None:
            return (kv,)
        layout = self.states.pool.layout
        return kv, (state_shapes(layout), state_dtype_tag(layout))

    def _install(self, load: _Load, caches: Sequence[Any]) -> int:
        """Put the leading intact blocks into the pools; returns how many (the rest is recomputed)."""
        formats = self._format(caches)
        good: list[tuple[BlockTransfer, HostBlock]] = []
        for transfer, future in zip(load.transfers, load.futures, strict=True):
            tensors = future.result()
            if tensors is None:
                break
            shapes, tag = formats[self._kind(transfer)]
            dtype = tensors.pop("dtype", None)
            if {k: v.shape for k, v in tensors.items()} != shapes or dtype is None or dtype.tobytes() != tag.encode():
                self.store.complaints.warn(
                    "shape", "KV disk tier: block %s has other pages than this pool: a miss", transfer.key[:16]
                )
                self.store.discard(transfer.key)
                break
            good.append((transfer, tensors))
        pages = [(t.block_id, b) for t, b in good if not self._is_state(t)]
        write_blocks(caches, [i for i, _ in pages], [b for _, b in pages], self.block_size)
        if self.states is not None:
            snapshots = [(t.block_id, b) for t, b in good if self._is_state(t)]
            write_states(self.states.pool, [i for i, _ in snapshots], [b for _, b in snapshots])
        return len(good)

    def get_finished(self) -> ConnectorOutput | None:
        if not self._finished:
            return None
        finished, self._finished = self._finished, {}
        return ConnectorOutput(finished_loads=finished)

    # ---- saves ----

    def save_kv(self, meta: ConnectorMetadata | None, caches: Sequence[Any]) -> None:
        if meta is None or not meta.saves:
            return
        tags = [np.frombuffer(tag.encode(), dtype=np.uint8) for _, tag in self._format(caches)]
        pages = [t for t in meta.saves if not self._is_state(t)]
        snapshots = [t for t in meta.saves if self._is_state(t)]
        blocks = read_blocks(caches, [t.block_id for t in pages], self.block_size)
        if self.states is not None and snapshots:
            blocks += read_states(self.states.pool, [t.block_id for t in snapshots])
        for transfer, block in zip(pages + snapshots, blocks, strict=True):
            tag = tags[self._kind(transfer)]
            size = sum(a.nbytes for a in block.values())
            with self._pending_lock:
                if self._pending_bytes + size > self.max_pending_bytes:
                    full = True
                else:
                    full = False
                    self._pending_bytes += size
            if full:
                self.store.drop_pending(transfer.key)
                self.store.complaints.warn(
                    "behind",
                    "KV disk tier: the disk is behind by %d MiB: a block is not saved",
                    self._pending_bytes >> 20,
                )
                continue
            block["dtype"] = tag
            self.store.stage(transfer.key, block)
            self._writes.put((transfer.key, block, {"block_size": str(self.block_size)}))

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            if item is None:
                return
            key, block, metadata = item
            try:
                self.store.write(key, block, metadata)
            except Exception:  # never let one block stop the writer
                logger.exception("KV disk tier: writing block %s failed", key[:16])
            finally:
                with self._pending_lock:
                    self._pending_bytes -= sum(a.nbytes for k, a in block.items() if k != "dtype")
                    self._pending_lock.notify_all()

    def wait_for_save(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._pending_lock:
            while self._pending_bytes > 0 or not self._writes.empty():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._pending_lock.wait(left if left is not None else 0.05)
        return True

    def close(self) -> None:
        self._writes.put(None)
        self._writer.join(timeout=30)
        self._readers.shutdown(wait=True)
