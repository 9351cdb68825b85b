"""The disk tier through the engine core on a tiny model: hits after a restart and after RAM eviction
give the tokens of a cold run; damaged files, a killed writer, a full or read-only disk cost only a
recompute."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from metalserve.config import ConfigError, EngineConfig
from metalserve.engine.core import EngineCore
from metalserve.kvcache.connector.disk_scheduler import DiskConnectorScheduler
from metalserve.kvcache.connector.disk_store import SUFFIX, DiskStore, decode_block
from metalserve.kvcache.specs import FullAttention, RecurrentState
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams
from metalserve.serving.build import build_engine_core
from metalserve.serving.kv_disk import attach_disk_tier
from tests.engine.test_core import run_all, tiny_loaded
from tests.executor.test_runner_golden import mlx_lm_greedy, prompts_of

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 8
PER_BLOCK = 2 * 2 * 2 * 16 * 4 * BLOCK  # layers * (K, V) * kv heads * head_dim * fp32 * block size


def make_core(
    directory: Path | str | None,
    *,
    blocks: int = 64,
    size: int | None = None,
    kv_dtype: str = "auto",
    async_scheduling: bool | None = None,
    attention_backend: str = "auto",
) -> EngineCore:
    config = EngineConfig(
        attention_backend=attention_backend,
        async_scheduling=async_scheduling,
        kv_cache_memory=blocks * PER_BLOCK,
        block_size=BLOCK,
        max_num_batched_tokens=64,
        max_model_len=64,
        kv_disk_dir=None if directory is None else str(directory),
        kv_disk_size=size,
        kv_cache_dtype=kv_dtype,
    )  # type: ignore[arg-type]
    return build_engine_core(config, tiny_loaded())


def expected(prompts: list[list[int]], n: int) -> list[list[int]]:
    model = tiny_loaded().model
    return [mlx_lm_greedy(model, p, n) for p in prompts]


def generate(core: EngineCore, prompts: list[list[int]], n: int) -> list[list[int]]:
    got, _ = run_all(core, prompts, n)
    return [got[f"r{i}"] for i in range(len(prompts))]


def connector(core: EngineCore) -> DiskConnectorScheduler:
    assert core.scheduler.kv_loads is not None
    c = core.scheduler.kv_loads.connector
    assert isinstance(c, DiskConnectorScheduler)
    return c


def block_keys(core: EngineCore, prompt: list[int]) -> list[str]:
    request = Request("probe", prompt, SamplingParams())
    core.scheduler.kv.hash_prompt(request)
    return [connector(core).namespace.key(h) for h in request.block_hashes]


PROMPT = prompts_of([40], 97, seed=11)[0]


def test_a_restart_on_the_same_directory_loads_the_prefix_from_disk(tmp_path: Path) -> None:
    want = expected([PROMPT], 8)
    first = make_core(tmp_path)
    assert generate(first, [PROMPT], 8) == want
    first.close()
    assert len(list(tmp_path.glob("*" + SUFFIX))) == 5  # 47 computed tokens: 5 full blocks
    second = make_core(tmp_path)
    assert generate(second, [PROMPT], 8) == want
    stats = second.make_stats().connector
    assert stats is not None and stats.hits == 32  # 4 blocks: the last prompt token is always computed
    assert stats.bytes_loaded > 0 and stats.usage_bytes == sum(p.stat().st_size for p in tmp_path.iterdir())
    second.close()


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "missing"])
def test_a_damaged_block_is_a_miss_and_the_tokens_equal_a_cold_run(tmp_path: Path, damage: str) -> None:
    want = expected([PROMPT], 8)
    first = make_core(tmp_path)
    generate(first, [PROMPT], 8)
    first.close()
    second = make_core(tmp_path)
    path = tmp_path / (block_keys(second, PROMPT)[2] + SUFFIX)
    data = bytearray(path.read_bytes())
    if damage == "corrupt":
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[: len(data) - 100]))
    else:
        path.unlink()
    assert generate(second, [PROMPT], 8) == want
    stats = second.make_stats().connector
    assert stats is not None and stats.hits == 16  # blocks 0 and 1; block 2 and what follows recomputed
    second.close()
    assert decode_block(path.read_bytes(), path.name[:64])  # recomputed and written through again


def test_blocks_evicted_from_ram_are_already_on_disk_and_come_back_from_it(tmp_path: Path) -> None:
    """A pool too small for two conversations, alternating between them: the returning one hits on disk."""
    a, b = prompts_of([40, 56], 97, seed=12)
    want = expected([a, b], 8)
    core = make_core(tmp_path, blocks=12)
    for _ in range(2):
        assert generate(core, [a], 8) == want[:1]
        assert generate(core, [b], 8) == want[1:]
    stats = core.make_stats().connector
    assert stats is not None and stats.hits >= 16
    assert core.scheduler.kv.pool.num_evictions > 0
    core.close()
    stored = {p.name[:64] for p in tmp_path.glob("*" + SUFFIX)}
    assert set(block_keys(core, a + want[0])[:5]) <= stored and set(block_keys(core, b + want[1])[:7]) <= stored


KILLED_WRITER = """
import os, sys, time
sys.path.insert(0, {root!r})
from metalserve.kvcache.connector import disk_store as store
from tests.engine.test_kv_disk import PROMPT, generate, make_core
fsync = os.fsync
def slow_fsync(fd):  # a slow disk: the kill lands while blocks are being written
    time.sleep(1.0)
    fsync(fd)
store.os.fsync = slow_fsync
core = make_core({directory!r})
generate(core, [PROMPT], 8)
print("generated", flush=True)
time.sleep(60)
"""


def test_a_writer_killed_mid_write_leaves_nothing_that_changes_the_tokens(tmp_path: Path) -> None:
    """kill -9 while blocks are being written (the engine-level twin of the server test), then a restart."""
    code = KILLED_WRITER.format(root=str(ROOT), directory=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, cwd=ROOT)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"generated"
        time.sleep(0.3)  # a block or none written, one in flight
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    written = list(tmp_path.glob("*" + SUFFIX))
    assert len(written) < 5 and list(tmp_path.glob("*.tmp"))  # killed with a write in flight
    core = make_core(tmp_path)
    assert not list(tmp_path.glob("*.tmp"))  # the dead writer's temporary file is gone at start-up
    for path in written:
        assert decode_block(path.read_bytes(), path.name[:64])  # every file that exists is whole
    assert generate(core, [PROMPT], 8) == expected([PROMPT], 8)
    core.close()


@pytest.mark.parametrize("trouble", ["tiny --kv-disk-size", "read-only directory"])
def test_a_disk_that_cannot_take_blocks_costs_a_log_line_not_the_engine(
    tmp_path: Path, trouble: str, caplog: pytest.LogCaptureFixture
) -> None:
    if trouble == "read-only directory":
        (tmp_path / "file").write_text("a file where the directory should be")
        directory, size = tmp_path / "file" / "kv", None
    else:
        directory, size = tmp_path, 1000  # less than one block
    with caplog.at_level(logging.WARNING, logger="metalserve.kv_disk"):
        core = make_core(directory, size=size)
        assert generate(core, [PROMPT], 8) == expected([PROMPT], 8)
        core.close()
    assert "KV disk tier" in caplog.text
    assert not list(tmp_path.glob("*" + SUFFIX))


def test_int8_pages_come_back_from_disk_with_their_scales(tmp_path: Path) -> None:
    """A restart hit with int8 pages gives the tokens of a cold int8 run (the codes alone, without their
    scales, would not). q4 needs head dims of 32+ (tests/executor/test_connector_pages.py covers its pages)."""
    kv_dtype = "int8"
    cold_core = make_core(None, kv_dtype=kv_dtype)
    cold = generate(cold_core, [PROMPT], 8)
    cold_core.close()
    first = make_core(tmp_path, kv_dtype=kv_dtype)
    assert generate(first, [PROMPT], 8) == cold
    first.close()
    files = sorted(tmp_path.glob("*" + SUFFIX))
    assert len(files) == 5
    tensors = decode_block(files[0].read_bytes(), files[0].name[:64])
    assert tensors is not None
    assert {"kv.0", "kv.0.scales"} <= set(tensors) and "kv.0.biases" not in tensors
    assert str(tensors["kv.0.scales"].dtype) == "float16"
    second = make_core(tmp_path, kv_dtype=kv_dtype)
    assert generate(second, [PROMPT], 8) == cold
    stats = second.make_stats().connector
    assert stats is not None and stats.hits == 32 and stats.bytes_loaded > 0
    second.close()
    # The storage dtype is in the key: float pages never read a quantized block.
    other = make_core(tmp_path)
    assert generate(other, [PROMPT], 8) == expected([PROMPT], 8)
    stats = other.make_stats().connector
    assert stats is not None and stats.hits == 0
    other.close()


def test_a_recurrent_state_without_snapshots_is_refused_at_start_up(tmp_path: Path) -> None:
    core = make_core(tmp_path)
    config = EngineConfig(block_size=BLOCK, kv_disk_dir=str(tmp_path))
    spec = core.runner.spec
    hybrid = replace(spec, groups=(*spec.groups, RecurrentState(layers=(1,), snapshots=False, state_bytes=64)))
    with pytest.raises(ConfigError, match="--kv-disk-dir: layer group 1 keeps a recurrent state that cannot be snap"):
        attach_disk_tier(config, tiny_loaded(), hybrid, core.scheduler, core.runner)
    assert isinstance(spec.groups[0], FullAttention) and spec.page.key == "float32"
    core.close()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kv_disk_size": 1 << 30}, "--kv-disk-size needs --kv-disk-dir"),
        ({"kv_disk_dir": "/tmp/x", "kv_disk_size": 0}, "--kv-disk-size must be a positive"),
        ({"kv_disk_dir": "/tmp/x", "enable_prefix_caching": False}, "--kv-disk-dir needs prefix caching"),
        ({"kv_disk_dir": " "}, "--kv-disk-dir must name a directory"),
    ],
)
def test_disk_flags_that_cannot_work_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**kwargs)  # type: ignore[arg-type]


def test_the_store_is_shared_by_both_halves(tmp_path: Path) -> None:
    core = make_core(tmp_path)
    assert core.runner.connector is not None and isinstance(connector(core).store, DiskStore)
    assert core.runner.connector.store is connector(core).store  # type: ignore[attr-defined]
    core.close()
