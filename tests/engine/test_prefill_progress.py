"""Prompt tokens are counted as each prefill chunk is computed (the throughput the stats line, /metrics and
the server view show follows a long prefill), a request aborted during its prefill keeps the tokens it
got through, and `AsyncEngine.prompt_progress` shows a running request's progress.

A real engine core on a tiny llama with a 32-token step budget: a 100-token prompt is prefilled in chunks
of 32, 32, 32 and 4 tokens."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from metalserve.config import EngineConfig
from metalserve.engine.async_engine import AsyncEngine
from metalserve.engine.engine_thread import EngineThread
from metalserve.engine.protocol import SchedulerStatsLike
from metalserve.engine.request_output import IterationStats
from metalserve.sampling_params import SamplingParams
from metalserve.serving.build import load_engine_core
from tests.e2e.family_dirs import write_model_dir

BUDGET = 32
PROMPT = [(7 * i) % 200 + 3 for i in range(100)]


class StepLog:
    """The observer: each step's prompt and generation tokens, and the engine's progress for one request."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int]] = []
        self.progress: list[tuple[int, int] | None] = []
        self.engine: AsyncEngine | None = None
        self.watch = ""
        self.first_chunk = threading.Event()
        self.pause = False  # hold the engine after the first chunk until `resume` is set
        self.resume = threading.Event()

    def on_step(self, scheduler_stats: SchedulerStatsLike, iteration: IterationStats) -> None:
        self.steps.append((iteration.num_prompt_tokens, iteration.num_generation_tokens))
        if self.engine is not None and self.watch:
            self.progress.append(self.engine.prompt_progress(self.watch))
        if iteration.num_prompt_tokens and not self.first_chunk.is_set():
            self.first_chunk.set()
            if self.pause:
                self.resume.wait(30)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture
def engine(model_dir: Path) -> Iterator[tuple[AsyncEngine, StepLog]]:
    config = EngineConfig(
        model=str(model_dir), kv_cache_memory=1 << 22, max_num_batched_tokens=BUDGET, max_model_len=256
    )
    thread = EngineThread()
    core, loaded = thread.call(load_engine_core, config)
    log = StepLog()
    engine = AsyncEngine(
        core,
        loaded.tokenizer,
        model_name="tiny",
        max_model_len=core.max_model_len,
        eos_token_ids=loaded.eos_token_ids,
        observer=log,
        thread=thread,
    )
    log.engine = engine
    try:
        yield engine, log
    finally:
        asyncio.run(engine.shutdown())
        thread.close()


def test_prompt_tokens_count_as_each_chunk_is_computed(engine: tuple[AsyncEngine, StepLog]) -> None:
    async_engine, log = engine
    log.watch = "r"
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    async def run() -> list[int]:
        return [len(out.token_ids) async for out in async_engine.generate(PROMPT, params, "r")]

    asyncio.run(run())
    prompt_steps = [p for p, _ in log.steps if p]
    assert prompt_steps == [32, 32, 32, 4], log.steps
    # the chunks came before the first token: three steps counted prompt tokens and generated nothing
    assert [g for p, g in log.steps if p][:3] == [0, 0, 0]
    assert sum(p for p, _ in log.steps) == len(PROMPT)
    # the progress a page polls, step by step; None once the request is over (read after the stream ended:
    # the observer of the last step may run before or after the engine drops the finished request)
    assert log.progress[:4] == [(32, 100), (64, 100), (96, 100), (100, 100)]
    assert async_engine.prompt_progress("r") is None


def test_a_request_aborted_during_prefill_keeps_its_prompt_tokens(engine: tuple[AsyncEngine, StepLog]) -> None:
    async_engine, log = engine
    log.pause = True
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    async def run() -> None:
        stream = async_engine.generate(PROMPT, params, "a")
        reader = asyncio.ensure_future(stream.__anext__())
        await asyncio.to_thread(log.first_chunk.wait, 30)
        reader.cancel()  # the client went away during the prefill
        await asyncio.gather(reader, return_exceptions=True)
        await stream.aclose()
        log.resume.set()  # the abort is queued: the engine applies it before its next step
        for _ in range(200):  # the abort reaches the worker thread
            if not async_engine.core.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)

    asyncio.run(run())
    counted = sum(p for p, _ in log.steps)
    assert counted == BUDGET, log.steps
    assert sum(g for _, g in log.steps) == 0
