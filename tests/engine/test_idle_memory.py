"""Idle a while after the last request ended, the engine hands back what the burst held: MLX's buffer cache
(and the allocator's freed heap), once per busy period, on the engine thread; back-to-back requests keep
their warm buffers."""

from __future__ import annotations

import asyncio
import threading

import mlx.core as mx
import pytest

from metalserve.config import EngineConfig
from metalserve.engine import async_engine
from metalserve.engine.async_engine import AsyncEngine
from metalserve.sampling_params import SamplingParams
from metalserve.serving.build import build_engine_core
from tests.api.fakes import FakeCore, tiny_tokenizer
from tests.engine.test_core import run_all, tiny_loaded
from tests.executor.test_runner_golden import prompts_of


def test_the_core_gives_back_mlx_s_buffer_cache() -> None:
    core = build_engine_core(EngineConfig(kv_cache_memory=1 << 22, block_size=8), tiny_loaded())
    run_all(core, prompts_of([40, 30, 20], 97, seed=3), 8)
    assert mx.get_cache_memory() > 0  # the steps' activations, freed but kept by MLX
    assert core.memory_report()["mlx_cache"] == mx.get_cache_memory()  # /debug/memory's mlx_cache
    core.release_idle_memory()
    assert mx.get_cache_memory() == 0 and core.memory_report()["mlx_cache"] == 0


class CountingCore(FakeCore):
    def __init__(self) -> None:
        super().__init__(tiny_tokenizer(), "A short reply.")
        self.releases: list[tuple[int, bool]] = []  # (thread, whether anything was still running)

    def release_idle_memory(self) -> None:
        self.releases.append((threading.get_ident(), self.has_unfinished_requests()))


def test_the_engine_releases_once_it_has_been_idle_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(async_engine, "IDLE_RELEASE_S", 0.3)
    core = CountingCore()
    engine = AsyncEngine(core, core.tokenizer, model_name="m", max_model_len=core.max_model_len, eos_token_ids={2})

    async def burst(tag: str, n: int) -> None:
        async def one(rid: str) -> None:
            prompt = core.tokenizer.encode(f"hello {rid}")
            async for _ in engine.generate(prompt, SamplingParams(max_tokens=4), rid):
                pass

        await asyncio.gather(*(one(f"{tag}{i}") for i in range(n)))

    async def scenario() -> list[int]:
        counts = []
        engine.start()
        try:
            await burst("a", 3)
            await burst("b", 2)  # back to back: within the idle window, nothing is released
            counts.append(len(core.releases))
            await asyncio.sleep(1.0)
            counts.append(len(core.releases))  # idle 1 s: released once
            await asyncio.sleep(0.5)
            counts.append(len(core.releases))  # and not again while idle
            await burst("c", 1)
            await asyncio.sleep(1.0)
            counts.append(len(core.releases))
        finally:
            await engine.shutdown()
        return counts

    assert asyncio.run(scenario()) == [0, 1, 1, 2]  # before: never (RSS stayed at the burst's peak)
    assert all(not running for _, running in core.releases)
    assert {thread for thread, _ in core.releases} <= core.threads  # on the engine thread
