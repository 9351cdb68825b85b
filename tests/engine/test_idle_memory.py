"""When the last running request ends the engine hands back what the burst held: MLX's buffer cache (and
the allocator's freed heap), once per busy period, on the engine thread."""

from __future__ import annotations

import asyncio
import threading

import mlx.core as mx

from metalserve.config import EngineConfig
from metalserve.engine.async_engine import AsyncEngine
from metalserve.engine.core import EngineCore
from metalserve.sampling_params import SamplingParams
from tests.api.fakes import FakeCore, tiny_tokenizer
from tests.engine.test_core import run_all, tiny_loaded
from tests.executor.test_runner_golden import prompts_of


def test_the_core_gives_back_mlx_s_buffer_cache() -> None:
    core = EngineCore.from_loaded(EngineConfig(kv_cache_memory=1 << 22, block_size=8), tiny_loaded())
    run_all(core, prompts_of([40, 30, 20], 97, seed=3), 8)
    assert mx.get_cache_memory() > 0  # the steps' activations, freed but kept by MLX
    core.release_idle_memory()
    assert mx.get_cache_memory() == 0


class CountingCore(FakeCore):
    def __init__(self) -> None:
        super().__init__(tiny_tokenizer(), "A short reply.")
        self.releases: list[tuple[int, bool]] = []  # (thread, whether anything was still running)

    def release_idle_memory(self) -> None:
        self.releases.append((threading.get_ident(), self.has_unfinished_requests()))


def test_the_engine_releases_once_each_time_it_goes_idle() -> None:
    core = CountingCore()
    engine = AsyncEngine(core, core.tokenizer, model_name="m", max_model_len=core.max_model_len, eos_token_ids={2})

    async def one(rid: str) -> None:
        prompt = core.tokenizer.encode(f"hello {rid}")
        async for _ in engine.generate(prompt, SamplingParams(max_tokens=4), rid):
            pass

    async def released(n: int) -> None:
        for _ in range(200):  # the engine thread releases right after the last output went out
            if len(core.releases) >= n:
                return
            await asyncio.sleep(0.01)

    async def bursts() -> None:
        engine.start()
        try:
            await asyncio.gather(*(one(f"a{i}") for i in range(3)))
            await released(1)
            await asyncio.gather(*(one(f"b{i}") for i in range(2)))
            await released(2)
            await asyncio.sleep(0.1)  # and not again while idle
        finally:
            await engine.shutdown()

    asyncio.run(bursts())
    assert len(core.releases) == 2  # before: never (the resident set stayed at the burst's peak)
    assert all(not running for _, running in core.releases)
    assert {thread for thread, _ in core.releases} <= core.threads  # on the engine thread
