"""A KV pool grown by a burst is cut back once the engine has idled a while (EngineCore.shrink_kv_pool): the
pool's bytes in /debug/memory and MLX's active memory fall, and the next requests regrow it and answer
the same tokens."""

from __future__ import annotations

import asyncio
import threading

import mlx.core as mx
import pytest

from metalserve.config import EngineConfig
from metalserve.engine import async_engine
from metalserve.engine.async_engine import AsyncEngine
from metalserve.engine.core import EngineCore
from metalserve.kvcache import plan as kv_plan
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams
from metalserve.serving.build import build_engine_core
from tests.api.fakes import FakeCore, tiny_tokenizer
from tests.engine.test_core import run_all, tiny_loaded
from tests.executor.test_runner_golden import prompts_of

CONFIG = EngineConfig(kv_cache_memory=1 << 24, block_size=8, max_num_seqs=16)


@pytest.fixture(autouse=True)
def small_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_plan, "INITIAL_POOL_BLOCKS", 4)  # a pool that starts at 4 blocks and grows


def burst(core: EngineCore, seed: int) -> dict[str, list[int]]:
    return run_all(core, prompts_of([60, 50, 40, 56, 44, 36], 97, seed=seed), 8)[0]


@pytest.mark.parametrize("storage", ["auto", "int8"])
def test_an_idle_core_gives_its_grown_pool_back_and_regrows_to_the_same_answers(storage: str) -> None:
    core = build_engine_core(EngineConfig(**{**CONFIG.__dict__, "kv_cache_dtype": storage}), tiny_loaded())
    pool = core.scheduler.kv.pool
    start, per_block = pool.num_allocated_blocks, core.kv_bytes_per_block
    first = burst(core, 3)
    grown = pool.num_allocated_blocks
    assert grown >= 4 * start  # the burst grew the pool by doublings
    assert core.memory_report()["kv_pool"] == grown * per_block
    core.release_idle_memory()
    before = mx.get_active_memory()
    assert core.shrink_kv_pool() == (grown - start) * per_block
    assert pool.num_allocated_blocks == start == core.runner.spec.num_blocks
    assert core.memory_report()["kv_pool"] == start * per_block  # /debug/memory's kv_pool
    assert before - mx.get_active_memory() >= 0.9 * (grown - start) * per_block  # the buffers went too
    assert core.shrink_kv_pool() == 0  # nothing left to give
    assert burst(core, 3) == first  # the pool regrows; same tokens (prefix hits below the cut or not)
    assert pool.num_allocated_blocks > start


def test_a_core_with_requests_keeps_its_pool() -> None:
    core = build_engine_core(CONFIG, tiny_loaded())
    burst(core, 3)
    grown = core.scheduler.kv.pool.num_allocated_blocks
    core.add_request(Request("x", prompts_of([40], 97, seed=9)[0], SamplingParams(max_tokens=4)))
    assert core.shrink_kv_pool() == 0
    assert core.scheduler.kv.pool.num_allocated_blocks == grown


class ShrinkCountingCore(FakeCore):
    def __init__(self) -> None:
        super().__init__(tiny_tokenizer(), "A short reply.")
        self.shrinks: list[tuple[int, bool]] = []  # (thread, whether anything was still running)

    def shrink_kv_pool(self) -> int:
        self.shrinks.append((threading.get_ident(), self.has_unfinished_requests()))
        return 0


def test_the_engine_shrinks_the_pool_once_after_a_longer_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(async_engine, "IDLE_RELEASE_S", 0.2)
    monkeypatch.setattr(async_engine, "KV_SHRINK_IDLE_S", 0.8)
    core = ShrinkCountingCore()
    engine = AsyncEngine(core, core.tokenizer, model_name="m", max_model_len=core.max_model_len, eos_token_ids={2})

    async def one(rid: str) -> None:
        async for _ in engine.generate(core.tokenizer.encode(f"hello {rid}"), SamplingParams(max_tokens=4), rid):
            pass

    async def scenario() -> list[int]:
        counts = []
        engine.start()
        try:
            await one("a")
            await asyncio.sleep(0.5)
            counts.append(len(core.shrinks))  # past the buffer release, not yet the pool
            await one("b")  # a request restarts the wait
            await asyncio.sleep(0.5)
            counts.append(len(core.shrinks))
            await asyncio.sleep(0.6)
            counts.append(len(core.shrinks))  # idle 1.1 s: shrunk once
            await asyncio.sleep(1.0)
            counts.append(len(core.shrinks))  # and not again while idle
        finally:
            await engine.shutdown()
        return counts

    assert asyncio.run(scenario()) == [0, 0, 1, 1]
    assert all(not running for _, running in core.shrinks)
    assert {thread for thread, _ in core.shrinks} <= core.threads  # on the engine thread
