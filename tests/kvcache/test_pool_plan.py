"""The one pool planner (kvcache/plan.py): the block counts every route gets, pinned for a few configs.
The numbers are the ones the six sizing sites gave before they were merged (compared config by config
over a grid of 120 when the planner replaced them)."""

from __future__ import annotations

import pytest

from metalserve.config import ConfigError, EngineConfig
from metalserve.kvcache.plan import (
    MachineMemory,
    bytes_for_requests,
    model_kv_share,
    plan_kv_pool,
    plan_stage_pool,
    pool_budget,
    stage_blocks_fit,
    stage_step_bytes,
)
from metalserve.kvcache.specs import FullAttention, KVCacheSpec, RecurrentState, SlidingWindow

GIB, MIB = 1 << 30, 1 << 20
SMOL = KVCacheSpec.uniform(30, 3, 64, "float16", 2, 16)  # SmolLM2-135M: 368,640 bytes a block
HYBRID = KVCacheSpec((*SMOL.groups, RecurrentState(layers=(30,), state_bytes=12345)), SMOL.tensors, 16)


def plan(spec: KVCacheSpec, memory: MachineMemory | None, peak: int, extra: int = 0, **config: int) -> tuple[int, int]:
    cfg = EngineConfig(gpu_memory_utilization=0.5, **config)  # type: ignore[arg-type]
    max_model_len = cfg.max_model_len
    assert max_model_len is not None
    return tuple(plan_kv_pool(cfg, spec, max_model_len, pool_budget(cfg, memory, peak), extra))  # type: ignore[return-value]


def test_a_server_on_a_machine_is_capped_by_its_requests() -> None:
    # 12 GiB may be used, far more than 8 requests of 2,048 tokens: 8 x 128 blocks + the null block.
    assert SMOL.bytes_per_block == 368_640
    memory = MachineMemory(total=24 * GIB, available=10 * GIB, held=2 * GIB)
    assert plan(SMOL, memory, 700 * MIB, max_model_len=2048, max_num_seqs=8) == (1025, 256)


def test_a_budget_from_memory_less_the_warm_up_peak_and_a_draft_s_bytes_per_block() -> None:
    # Half of 16 GiB less a 300 MiB peak, over 368,640 + 4,096 (a draft's K/V) bytes a block.
    memory = MachineMemory(total=16 * GIB, available=None, held=0)
    assert plan(SMOL, memory, 300 * MIB, extra=4096, max_model_len=8192, max_num_seqs=256) == (22201, 256)


def test_kv_cache_memory_counts_the_state_slot_of_every_block() -> None:
    # 64 MiB over 368,640 + 12,345 bytes: 176 blocks, all allocated at once (fewer than 256).
    assert plan(HYBRID, None, 0, kv_cache_memory=64 * MIB, max_model_len=2048, max_num_seqs=256) == (176, 176)
    assert plan(SMOL, None, 0, kv_cache_memory=3 * GIB, max_model_len=1000, max_num_seqs=1) == (64, 64)


def test_a_budget_too_small_for_one_request_says_what_is_missing() -> None:
    with pytest.raises(ConfigError, match="needs 513 blocks"):
        plan(SMOL, None, 0, kv_cache_memory=64 * MIB, max_model_len=8192, max_num_seqs=1)


def test_generate_gets_room_for_every_prompt_and_the_null_block() -> None:
    assert bytes_for_requests(SMOL, 3, 512) == (3 * 32 + 1) * 368_640
    assert bytes_for_requests(HYBRID, 3, 512) == (3 * (32 + 2) + 1) * (368_640 + 12_345)


def test_several_models_share_half_the_budget() -> None:
    assert model_kv_share(12 * GIB, 3) == 2 * GIB


def test_pipeline_stages_take_the_smallest_stage_and_the_cap() -> None:
    config = EngineConfig(gpu_memory_utilization=0.5, max_num_batched_tokens=512, max_num_seqs=4)
    step = stage_step_bytes(config, 4, hidden=576, intermediate=1536, vocab=49152, first=True)
    assert step == 512 * 4 * (8 * 576 + 3 * 1536) + 4 * 49152 * 4
    memory = MachineMemory(total=8 * GIB, available=None, held=GIB)
    assert stage_blocks_fit(config, 1 * MIB, memory, step) == (4 * GIB - GIB - step) // MIB
    given = EngineConfig(kv_cache_memory=100 * MIB)
    assert stage_blocks_fit(given, MIB, None, step) == 100
    assert tuple(plan_stage_pool(config, [3000, 2000], 1024)) == (4 * 64 + 1, 256)  # 256: the initial pool
    assert tuple(plan_stage_pool(config, [3000, 200], 1024)) == (200, 200)
    # A model of several layer groups (the whole model's, every stage keeps them): a request holds blocks
    # in each, a recurrent state at most two.
    groups = (FullAttention(), SlidingWindow(16), RecurrentState())
    assert plan_stage_pool(config, [3000, 2000], 1024, groups).num_blocks == 4 * (64 + 64 + 2) + 1
