"""An in-memory block index for the disk connector's scheduler half (no files, no MLX)."""

from __future__ import annotations

from metalserve.kvcache.connector.base import ConnectorMetadata


class MemoryIndex:
    """The store as the scheduler half sees it; `commit` plays the writer thread for a step's saves."""

    def __init__(self, capacity_bytes: int = 1 << 30) -> None:
        self.writable = True
        self.bytes_loaded = 0
        self.bytes_saved = 0
        self.load_seconds = 0.0
        self.usage_bytes = 0
        self.capacity_bytes = capacity_bytes
        self.stored: dict[str, list[int]] = {}  # key -> what the block held (tests put token ids here)
        self.pending: set[str] = set()

    def contains(self, key: str) -> bool:
        return key in self.stored

    def has_or_pending(self, key: str) -> bool:
        return key in self.stored or key in self.pending

    def mark_pending(self, key: str) -> None:
        self.pending.add(key)

    def commit(self, meta: ConnectorMetadata | None, contents: dict[int, list[int]] | None = None) -> None:
        """Store the step's saved blocks (`contents`: block id -> what it holds; [] when not given)."""
        if meta is None:
            return
        for block_id, key, _group in meta.saves:
            self.pending.discard(key)
            self.stored[key] = list((contents or {}).get(block_id, []))
