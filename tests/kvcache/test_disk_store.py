"""The disk tier's directory: atomic writes, checksums, LRU bound, restart index, failures as misses."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import numpy as np
import pytest

from metalserve.kvcache.connector import disk_store as store_module
from metalserve.kvcache.connector.disk_store import SUFFIX, DiskStore, decode_block, encode_block

KEYS = [f"{i:064x}" for i in range(1, 8)]


def block(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "kv.0": rng.standard_normal((2, 2, 8, 16)).astype(np.float32),
        "kv.1": np.full((2, 2, 8, 16), seed, np.float32),
    }


def block_bytes() -> int:
    return len(encode_block(KEYS[0], block(0)))


def test_a_block_round_trips_and_the_directory_holds_only_final_files(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 1 << 20)
    assert store.writable and store.write(KEYS[0], block(0))
    got = store.read(KEYS[0])
    assert got is not None and all(np.array_equal(got[k], v) for k, v in block(0).items())
    assert sorted(p.name for p in tmp_path.iterdir()) == [KEYS[0] + SUFFIX]
    assert store.usage_bytes == block_bytes() == store.bytes_saved == store.bytes_loaded


@pytest.mark.parametrize("damage", ["flip a data byte", "flip a header byte", "truncate", "empty", "delete", "rename"])
def test_a_damaged_or_missing_file_is_a_logged_miss_and_is_removed(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = DiskStore(tmp_path, 1 << 20)
    store.write(KEYS[0], block(0))
    store.write(KEYS[1], block(1))
    path = store.path(KEYS[0])
    data = bytearray(path.read_bytes())
    if damage == "flip a data byte":
        data[-5] ^= 0x40
        path.write_bytes(bytes(data))
    elif damage == "flip a header byte":
        data[20] ^= 0x01
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "delete":
        path.unlink()
    else:  # another block's file under this key's name
        os.replace(store.path(KEYS[1]), path)
    with caplog.at_level(logging.WARNING, logger="metalserve.kv_disk"):
        assert store.read(KEYS[0]) is None
    assert "KV disk tier" in caplog.text
    assert not path.exists() and not store.contains(KEYS[0])


def test_lru_keeps_the_directory_within_its_size_and_a_hit_refreshes_a_block(tmp_path: Path) -> None:
    size = block_bytes()
    store = DiskStore(tmp_path, 3 * size)
    for i in range(3):
        store.write(KEYS[i], block(i))
    assert store.read(KEYS[0]) is not None  # now the most recently used
    store.write(KEYS[3], block(3))  # evicts KEYS[1], the least recently used
    assert store.keys() == [KEYS[2], KEYS[0], KEYS[3]]
    assert sorted(p.name[:64] for p in tmp_path.iterdir()) == sorted(store.keys())
    assert store.usage_bytes == 3 * size == sum(p.stat().st_size for p in tmp_path.iterdir())


def test_a_restart_rebuilds_the_index_from_names_sizes_and_mtimes_without_reading_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    size = block_bytes()
    store = DiskStore(tmp_path, 10 * size)
    for i in range(4):
        store.write(KEYS[i], block(i))
        os.utime(store.path(KEYS[i]), ns=(10**18 + i, 10**18 + [2, 0, 3, 1][i]))  # LRU order 1, 3, 0, 2
    (tmp_path / f"{KEYS[5]}.123.456.tmp").write_bytes(b"half a block")  # a writer that died
    (tmp_path / "notes.txt").write_text("not a block")
    monkeypatch.setattr(store_module, "decode_block", lambda *a: pytest.fail("the scan read block data"))
    again = DiskStore(tmp_path, 3 * size)  # smaller now: the oldest goes at once
    assert again.keys() == [KEYS[3], KEYS[0], KEYS[2]]
    assert not store.path(KEYS[1]).exists() and not list(tmp_path.glob("*.tmp"))
    assert (tmp_path / "notes.txt").exists() and again.usage_bytes == 3 * size


def test_a_block_larger_than_the_directory_is_not_saved(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = DiskStore(tmp_path, block_bytes() - 1)
    with caplog.at_level(logging.WARNING, logger="metalserve.kv_disk"):
        assert not store.write(KEYS[0], block(0))
    assert "more than --kv-disk-size" in caplog.text and not list(tmp_path.iterdir())


def test_a_full_disk_fails_the_write_with_a_log_line_and_leaves_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    store = DiskStore(tmp_path, 1 << 20)

    def full(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_module.os, "write", full)
    with caplog.at_level(logging.WARNING, logger="metalserve.kv_disk"):
        assert not store.write(KEYS[0], block(0))
    assert "No space left on device" in caplog.text
    assert not list(tmp_path.iterdir()) and store.usage_bytes == 0 and not store.has_or_pending(KEYS[0])


def test_a_directory_that_cannot_be_written_serves_reads_only(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file where the directory should be")
    with caplog.at_level(logging.WARNING, logger="metalserve.kv_disk"):
        store = DiskStore(blocker / "kv", 1 << 20)
    assert not store.writable and "cannot write" in caplog.text
    assert not store.write(KEYS[0], block(0)) and store.read(KEYS[0]) is None


def test_decode_checks_the_key_it_was_written_for() -> None:
    data = encode_block(KEYS[0], block(0))
    assert np.array_equal(decode_block(data, KEYS[0])["kv.1"], block(0)["kv.1"])
    with pytest.raises(store_module.CorruptBlock, match="another key"):
        decode_block(data, KEYS[1])


def test_a_block_queued_for_writing_is_found_and_read_from_memory(tmp_path: Path) -> None:
    """Write-through: a block the RAM cache evicts before its file is written is still a hit."""
    store = DiskStore(tmp_path, 1 << 20)
    store.mark_pending(KEYS[0])
    assert not store.contains(KEYS[0]) and store.has_or_pending(KEYS[0])  # offered, no pages yet
    store.stage(KEYS[0], block(0))
    assert store.contains(KEYS[0]) and not list(tmp_path.iterdir())
    got = store.read(KEYS[0])
    assert got is not None and np.array_equal(got["kv.0"], block(0)["kv.0"])
    store.write(KEYS[0], block(0))
    assert store.contains(KEYS[0]) and not store.has_or_pending(KEYS[1])
    store.mark_pending(KEYS[1])
    store.stage(KEYS[1], block(1))
    store.drop_pending(KEYS[1])  # the writer fell behind and gave it up
    assert not store.contains(KEYS[1]) and not store.has_or_pending(KEYS[1])


def test_a_disk_that_fills_before_the_tier_is_full_evicts_least_recently_used_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    store = DiskStore(tmp_path, 1 << 20)  # the tier may grow to 1 MiB; the disk holds only three blocks
    disk_size = 3 * block_bytes()
    real_write = os.write

    def small_disk(fd: int, data: bytes | memoryview) -> int:
        used = sum(p.stat().st_size for p in tmp_path.iterdir())
        if used + len(data) > disk_size:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(store_module.os, "write", small_disk)
    for key in KEYS[:3]:
        assert store.write(key, block(0))
    assert store.read(KEYS[0]) is not None  # block 0 is now the most recently used
    with caplog.at_level(logging.WARNING, logger="metalserve.kv_disk"):
        assert store.write(KEYS[3], block(3))  # before: refused, and every later write too
    assert "disk is full" in caplog.text
    assert set(store.keys()) == {KEYS[0], KEYS[2], KEYS[3]}
    assert not store.contains(KEYS[1])  # the least recently used went
    assert store.usage_bytes == sum(p.stat().st_size for p in tmp_path.iterdir())


def test_a_damaged_block_that_cannot_be_removed_is_not_logged_as_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    store = DiskStore(tmp_path, 1 << 20)
    assert store.write(KEYS[0], block(0))
    path = store.path(KEYS[0])
    path.write_bytes(path.read_bytes()[:-10])

    def read_only(self: Path, missing_ok: bool = False) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(Path, "unlink", read_only)
    with caplog.at_level(logging.WARNING, logger="metalserve.kv_disk"):
        assert store.read(KEYS[0]) is None
    assert "left in place" in caplog.text and "a miss, removed" not in caplog.text  # before: "a miss, removed"
    assert path.exists()
