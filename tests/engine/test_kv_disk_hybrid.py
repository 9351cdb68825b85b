"""The disk tier on a hybrid model (a tiny random qwen3_5: gated-delta layers with a conv and a recurrent
state each, and full-attention layers): the state snapshot at a block boundary is saved with the block, a
restart on the same directory loads the prefix's KV blocks and its last snapshot and gives the tokens of a
cold run; a damaged or missing snapshot costs a recompute (or a shorter prefix), never other tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from metalserve.config import EngineConfig
from metalserve.engine.core import EngineCore
from metalserve.kvcache.connector.disk_scheduler import RECURRENT_STATE, DiskConnectorScheduler
from metalserve.kvcache.connector.disk_store import SUFFIX, decode_block
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams
from metalserve.serving.build import build_engine_core
from tests.models import golden
from tests.models.hybrid_golden import BLOCK_SIZE, bytes_per_block, prompts_of
from tests.models.hybrid_tiny import tiny_hybrid_loaded

MODEL = "qwen3_5"
PROMPT = prompts_of([45], seed=21)[0]  # chunks of 16 end at 16 and 32 (snapshots of blocks 0 and 1), then 45
N = 8


def make_core(directory: Path | None, async_scheduling: bool | None = None) -> EngineCore:
    loaded = tiny_hybrid_loaded(MODEL)
    config = EngineConfig(
        async_scheduling=async_scheduling,
        kv_cache_memory=bytes_per_block(loaded) * 64,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=16,
        max_model_len=128,
        kv_disk_dir=None if directory is None else str(directory),
    )
    return build_engine_core(config, loaded)


def connector(core: EngineCore) -> DiskConnectorScheduler:
    assert core.scheduler.kv_loads is not None
    c = core.scheduler.kv_loads.connector
    assert isinstance(c, DiskConnectorScheduler)
    return c


def snapshot_path(core: EngineCore, directory: Path, block: int) -> Path:
    """The file of the state snapshot at the end of `block` of PROMPT."""
    probe = Request("probe", PROMPT, SamplingParams())
    core.scheduler.kv.hash_prompt(probe)
    c = connector(core)
    namespace = c.namespaces[c.windows.index(RECURRENT_STATE)]
    return directory / (namespace.key(probe.block_hashes[block]) + SUFFIX)


@pytest.fixture(scope="module")
def cold_tokens() -> list[int]:
    core = make_core(None)
    return golden.serve(core, [PROMPT], N)[0].tokens


def test_a_restart_loads_the_kv_blocks_and_the_last_snapshot(tmp_path: Path, cold_tokens: list[int]) -> None:
    first = make_core(tmp_path)
    assert golden.serve(first, [PROMPT], N)[0].tokens == cold_tokens
    first.close()
    # 52 computed tokens: 3 full blocks of KV, and 3 snapshots (16, 32, and 48 reached while decoding).
    assert len(list(tmp_path.glob("*" + SUFFIX))) == 6
    path = snapshot_path(first, tmp_path, 1)
    snapshot = decode_block(path.read_bytes(), path.name[:64])
    # Two gated-delta layers, each with its conv and recurrent state.
    assert sorted(snapshot) == ["dtype", "state.0.0", "state.0.1", "state.1.0", "state.1.1"]

    second = make_core(tmp_path)
    got = golden.serve(second, [PROMPT], N)[0]
    stats = second.make_stats().connector
    second.close()
    assert stats is not None and stats.hits == 32  # 2 blocks of KV and the state after token 32
    assert got.cached_tokens == 32
    assert got.tokens == cold_tokens


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_a_damaged_snapshot_is_a_miss_and_the_tokens_equal_a_cold_run(
    tmp_path: Path, cold_tokens: list[int], damage: str
) -> None:
    first = make_core(tmp_path)
    golden.serve(first, [PROMPT], N)
    first.close()
    path = snapshot_path(first, tmp_path, 1)  # damaged between the two runs
    if damage == "corrupt":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        path.unlink()
    second = make_core(tmp_path)
    got = golden.serve(second, [PROMPT], N)[0]
    stats = second.make_stats().connector
    second.close()
    assert got.tokens == cold_tokens
    assert stats is not None
    # Corrupt: found at read time, after the plan chose 32 tokens: everything is recomputed. Missing (the
    # restart's index lacks it): the plan ends at the snapshot before it, block 0's (16 tokens).
    assert stats.hits == (0 if damage == "corrupt" else 16)
    assert decode_block(path.read_bytes(), path.name[:64])  # recomputed and written through again
