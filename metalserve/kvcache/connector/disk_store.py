"""A directory of KV blocks, one safetensors file per block, bounded in bytes with LRU eviction.

The index (key -> size, in LRU order) is rebuilt at start-up from file names, sizes and mtimes alone:
no block data is read. A hit refreshes the file's mtime, so the LRU order survives a restart. Writes
are atomic (a temporary file, fsync, rename); every file carries a CRC-32 of its tensors and its own
key, so a missing, truncated or corrupt file is found on read, logged, removed and served as a miss.
Every failure of the disk (full, read-only, gone) is logged and costs only a recompute.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import struct
import threading
import time
import zlib
from collections import OrderedDict
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

logger = logging.getLogger("metalserve.kv_disk")

SUFFIX = ".safetensors"
TEMP_SUFFIX = ".tmp"
_KEY = re.compile(r"^[0-9a-f]{64}$")


class CorruptBlock(Exception):
    """A stored block that cannot be trusted (its message says why)."""


def checksum(tensors: dict[str, np.ndarray]) -> str:
    """CRC-32 over the tensors' names, dtypes, shapes and bytes, in name order."""
    crc = 0
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        crc = zlib.crc32(f"{name}|{arr.dtype.str}|{arr.shape}".encode(), crc)
        crc = zlib.crc32(arr.data.cast("B"), crc)
    return f"{crc:08x}"


def _metadata_of(data: bytes) -> dict[str, str]:
    """The `__metadata__` of a safetensors buffer (its header is an 8-byte length and JSON)."""
    if len(data) < 8:
        raise CorruptBlock("shorter than a safetensors header")
    (length,) = struct.unpack("<Q", data[:8])
    if length > len(data) - 8:
        raise CorruptBlock("truncated header")
    try:
        header = json.loads(data[8 : 8 + length])
    except ValueError as exc:
        raise CorruptBlock(f"unreadable header ({exc})") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict):
        raise CorruptBlock("no metadata")
    return meta


def decode_block(data: bytes, key: str) -> dict[str, np.ndarray]:
    """The tensors of a stored block, checked against its key and checksum; CorruptBlock if not."""
    meta = _metadata_of(data)
    if meta.get("key") != key:
        raise CorruptBlock("it holds another key")
    try:
        tensors = st_load(data)
    except SafetensorError as exc:
        raise CorruptBlock(f"unreadable tensors ({exc})") from None
    if meta.get("crc32") != checksum(tensors):
        raise CorruptBlock("checksum mismatch")
    return tensors


def encode_block(key: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> bytes:
    return st_save(tensors, metadata={**(metadata or {}), "key": key, "crc32": checksum(tensors)})


class _Complaints:
    """Log a kind of failure at its 1st, 10th, 100th, ... occurrence: visible, never a flood."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def warn(self, kind: str, message: str, *args: object) -> None:
        with self._lock:
            n = self._counts[kind] = self._counts.get(kind, 0) + 1
        if str(n).rstrip("0") == "1":  # 1, 10, 100, ...
            logger.warning(message + (f" ({n} times so far)" if n > 1 else ""), *args)


class DiskStore:
    """The directory and its index. Thread-safe: the scheduler asks `contains`, a writer thread
    `write`s, reader threads `read`."""

    def __init__(self, directory: str | os.PathLike[str], capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"the disk tier's size must be positive, got {capacity_bytes}")
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # least recently used first
        # Offered for writing: None until the worker hands over the pages, then the pages themselves until
        # the file is written, so a block is found (and read from memory) from the step that computed it.
        self._pending: dict[str, dict[str, np.ndarray] | None] = {}
        self.usage_bytes = 0
        self.bytes_loaded = 0
        self.bytes_saved = 0
        self.load_seconds = 0.0
        self.complaints = _Complaints()
        self.writable = self._prepare()
        started = time.perf_counter()
        self._scan()
        logger.info(
            "KV disk tier: %s, %d blocks (%.1f MiB of %.1f MiB) indexed in %.0f ms%s",
            self.directory,
            len(self._index),
            self.usage_bytes / 2**20,
            capacity_bytes / 2**20,
            1000 * (time.perf_counter() - started),
            "" if self.writable else "; read-only: nothing new is saved",
        )

    def _prepare(self) -> bool:
        """Create the directory and probe that files can be created in it."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / f".probe-{os.getpid()}{TEMP_SUFFIX}"
            probe.write_bytes(b"")
            probe.unlink()
            return True
        except OSError as exc:
            logger.warning("KV disk tier: cannot write to %s (%s): blocks are not saved", self.directory, exc)
            return False

    def _scan(self) -> None:
        """Index the directory from names, sizes and mtimes (oldest first); drop leftover temporary files
        of a server that died while writing."""
        found: list[tuple[int, str, int]] = []
        try:
            with os.scandir(self.directory) as entries:
                for entry in entries:
                    name = entry.name
                    if name.endswith(TEMP_SUFFIX):
                        self._unlink(Path(entry.path))
                        continue
                    key = name[: -len(SUFFIX)]
                    if name.endswith(SUFFIX) and _KEY.match(key) and entry.is_file():
                        st = entry.stat()
                        found.append((st.st_mtime_ns, key, st.st_size))
        except OSError as exc:
            logger.warning("KV disk tier: cannot list %s (%s): starting empty", self.directory, exc)
        for _, key, size in sorted(found):
            self._index[key] = size
            self.usage_bytes += size
        for victim in self._evict_over_capacity():  # a smaller --kv-disk-size than last time
            self._unlink(self.path(victim))

    def path(self, key: str) -> Path:
        return self.directory / f"{key}{SUFFIX}"

    def contains(self, key: str) -> bool:
        """On disk, or on its way there with its pages in memory."""
        return key in self._index or self._pending.get(key) is not None

    def has_or_pending(self, key: str) -> bool:
        with self._lock:
            return key in self._index or key in self._pending

    def mark_pending(self, key: str) -> None:
        with self._lock:
            self._pending.setdefault(key, None)

    def stage(self, key: str, tensors: dict[str, np.ndarray]) -> None:
        """The pages of a block queued for writing (readers take them from here until it is written)."""
        with self._lock:
            self._pending[key] = tensors

    def drop_pending(self, key: str) -> None:
        """A queued write that was given up (the writer fell behind): the block may be offered again."""
        with self._lock:
            self._pending.pop(key, None)

    def keys(self) -> list[str]:
        """Least recently used first."""
        with self._lock:
            return list(self._index)

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    # ---- writing (the writer thread) ----

    def write(self, key: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> bool:
        """Store one block atomically; False (logged) when it cannot be."""
        try:
            return self._write(key, encode_block(key, tensors, metadata))
        finally:
            with self._lock:
                self._pending.pop(key, None)

    def _write(self, key: str, data: bytes) -> bool:
        if not self.writable:
            return False
        if len(data) > self.capacity_bytes:
            self.complaints.warn(
                "size",
                "KV disk tier: a block of %d bytes is more than --kv-disk-size %d: not saved",
                len(data),
                self.capacity_bytes,
            )
            return False
        written = self._write_file(key, data)
        if written is not None and written.errno in (errno.ENOSPC, errno.EDQUOT) and self._make_room(len(data)):
            written = self._write_file(key, data)  # the disk filled before --kv-disk-size: LRU blocks made room
        if written is not None:
            self.complaints.warn(
                "write", "KV disk tier: cannot write a block to %s (%s): it will be recomputed", self.directory, written
            )
            return False
        with self._lock:
            self.usage_bytes += len(data) - self._index.pop(key, 0)
            self._index[key] = len(data)
            self.bytes_saved += len(data)
            victims = self._evict_over_capacity()
        for victim in victims:
            self._unlink(self.path(victim))
        return True

    def _write_file(self, key: str, data: bytes) -> OSError | None:
        """Write the block's file atomically; the error when it could not be."""
        final = self.path(key)
        temp = self.directory / f"{key}.{os.getpid()}.{threading.get_ident()}{TEMP_SUFFIX}"
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temp, final)
        except OSError as exc:
            self._unlink(temp)
            return exc
        return None

    def _make_room(self, needed: int) -> bool:
        """The disk is full though the tier is under its size: remove least recently used blocks, at least
        `needed` bytes and a tenth of what the tier holds (so a full disk is not met at every write)."""
        with self._lock:
            target = max(needed, self.usage_bytes // 10)
            victims = []
            while target > 0 and self._index:
                key, size = self._index.popitem(last=False)
                self.usage_bytes -= size
                target -= size
                victims.append(key)
        for victim in victims:
            self._unlink(self.path(victim))
        if victims:
            self.complaints.warn(
                "full", "KV disk tier: the disk is full: %d least recently used blocks removed", len(victims)
            )
        return bool(victims)

    def _evict_over_capacity(self) -> list[str]:
        """Drop least recently used entries until the index fits; returns their keys (to unlink)."""
        victims = []
        while self.usage_bytes > self.capacity_bytes and self._index:
            key, size = self._index.popitem(last=False)
            self.usage_bytes -= size
            victims.append(key)
        return victims

    # ---- reading (reader threads) ----

    def read(self, key: str) -> dict[str, np.ndarray] | None:
        """The block's tensors, or None (a miss): a missing, truncated or corrupt file is logged and removed."""
        started = time.perf_counter()
        with self._lock:
            staged = self._pending.get(key)
        if staged is not None:
            return dict(staged)
        path = self.path(key)
        try:
            data = path.read_bytes()
            tensors = decode_block(data, key)
        except FileNotFoundError:
            self.complaints.warn("missing", "KV disk tier: %s is gone: a miss", path.name)
            self.discard(key)
            return None
        except (OSError, CorruptBlock) as exc:
            removed = "removed" if self.discard(key) else "left in place (it cannot be removed)"
            self.complaints.warn("corrupt", "KV disk tier: %s cannot be used (%s): a miss, %s", path.name, exc, removed)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # the LRU order outlives the process
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
            self.bytes_loaded += len(data)
            self.load_seconds += time.perf_counter() - started
        return tensors

    def discard(self, key: str) -> bool:
        """Forget a block and remove its file (a failed read, or pages of the wrong shape); False when the
        file is still there (a read-only mount)."""
        with self._lock:
            self.usage_bytes -= self._index.pop(key, 0)
        return self._unlink(self.path(key))

    @staticmethod
    def _unlink(path: Path) -> bool:
        """Remove `path`; True when it is gone (or was already)."""
        try:
            path.unlink()
        except FileNotFoundError:
            return True
        except OSError:
            return False
        return True
