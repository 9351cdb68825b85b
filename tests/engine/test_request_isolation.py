"""One request that fails inside the engine fails alone; a reader that stops reading is cut off."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from metalserve.config import EngineConfig
from metalserve.engine import async_engine, request_state
from metalserve.engine.async_engine import AsyncEngine, ClientTooSlowError
from metalserve.engine.detokenizer import IncrementalDetokenizer
from metalserve.engine.engine_thread import EngineThread
from metalserve.sampling_params import SamplingParams
from metalserve.serving.build import build_engine_core
from tests.api.fakes import FakeCore, tiny_tokenizer
from tests.engine.test_core import tiny_loaded
from tests.executor.test_runner_golden import mlx_lm_greedy, prompts_of

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _real_engine() -> tuple[AsyncEngine, list[list[int]], list[list[int]]]:
    loaded = tiny_loaded()
    prompts = prompts_of([12, 40, 25], loaded.model.args.vocab_size, seed=5)
    expected = [mlx_lm_greedy(loaded.model, p, 12) for p in prompts]
    config = EngineConfig(kv_cache_memory=1 << 22, max_num_batched_tokens=32, block_size=8)
    thread = EngineThread()  # as the server does: the core is built on the thread that steps it
    core = thread.call(build_engine_core, config, loaded)
    engine = AsyncEngine(
        core, tiny_tokenizer(), model_name="tiny", max_model_len=256, eos_token_ids=set(), thread=thread
    )
    return engine, prompts, expected


async def _tokens(engine: AsyncEngine, prompt: list[int], rid: str, salt: str | None = None) -> list[int]:
    return [t async for out in engine.generate(prompt, GREEDY, rid, cache_salt=salt) for t in out.token_ids]


def test_a_salt_that_cannot_be_hashed_fails_its_request_only() -> None:
    """The engine-killing bug: a lone surrogate in cache_salt raised inside a step on the engine thread."""

    async def main() -> None:
        engine, prompts, expected = _real_engine()
        runs = [
            _tokens(engine, prompts[0], "a"),
            _tokens(engine, prompts[1], "b", "\ud800"),
            _tokens(engine, prompts[2], "c"),
        ]
        a, b, c = await asyncio.gather(*runs, return_exceptions=True)
        assert isinstance(b, ValueError) and "not valid Unicode" in str(b)
        assert [a, c] == [expected[0], expected[2]]
        assert engine.is_running and await _tokens(engine, prompts[1], "again", "salt") == expected[1]
        await engine.shutdown()

    asyncio.run(main())


def test_a_request_whose_detokenizing_fails_gets_an_error_and_the_others_finish(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Failing(IncrementalDetokenizer):
        def update(self, new_token_ids: list[int], finished: bool) -> str:
            raise RuntimeError("injected detokenizer failure")

    def detokenizer(tokenizer: Any, prompt: list[int], params: SamplingParams) -> IncrementalDetokenizer:
        cls = Failing if len(prompt) == 40 else IncrementalDetokenizer
        return cls(tokenizer, prompt, params)

    monkeypatch.setattr(async_engine, "IncrementalDetokenizer", detokenizer)

    async def main() -> None:
        engine, prompts, expected = _real_engine()
        runs = [_tokens(engine, p, f"r{i}") for i, p in enumerate(prompts)]
        a, b, c = await asyncio.gather(*runs, return_exceptions=True)
        assert isinstance(b, RuntimeError) and "injected" in str(b)
        assert [a, c] == [expected[0], expected[2]] and engine.is_running
        await engine.shutdown()

    asyncio.run(main())


def test_a_reader_that_falls_behind_gets_merged_deltas() -> None:
    async def main() -> None:
        core = FakeCore(tiny_tokenizer(), "one two three four five six seven eight nine ten", step_delay=0.002)
        engine = AsyncEngine(core, core.tokenizer, model_name="t", max_model_len=256, eos_token_ids={2})
        outs = []
        async for out in engine.generate([5, 6, 7], SamplingParams(max_tokens=40), "slow"):
            outs.append(out)
            await asyncio.sleep(0.02)  # several steps pass while this reader is busy
        assert "".join(o.text for o in outs) == "one two three four five six seven eight nine ten"
        assert sum(len(o.token_ids) for o in outs) == outs[-1].num_output_tokens
        assert len(outs) < outs[-1].num_output_tokens  # some deltas came merged
        await engine.shutdown()

    asyncio.run(main())


def test_a_reader_that_stops_reading_is_aborted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(request_state, "MAX_UNREAD_OUTPUTS", 8)

    async def main() -> None:
        core = FakeCore(tiny_tokenizer(), "word " * 100, step_delay=0.001)
        engine = AsyncEngine(core, core.tokenizer, model_name="t", max_model_len=256, eos_token_ids={2})
        stream = engine.generate([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True), "stuck")
        await stream.__anext__()
        deadline = time.monotonic() + 10
        while "stuck" not in core.aborted:  # the reader sleeps; its backlog passes the bound
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        with pytest.raises(ClientTooSlowError):
            async for _ in stream:
                pass
        assert core.steps < 200 and not core.running
        await engine.shutdown()

    asyncio.run(main())


def test_shutdown_gives_up_on_a_step_that_does_not_end() -> None:
    async def main() -> None:
        core = FakeCore(tiny_tokenizer(), "x", step_delay=3.0)
        engine = AsyncEngine(core, core.tokenizer, model_name="t", max_model_len=256, eos_token_ids={2})
        stream = engine.generate([5], SamplingParams(max_tokens=5), "r")
        task = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.2)  # the worker is inside its 3-second step
        start = time.monotonic()
        await engine.shutdown(timeout=0.3)
        assert time.monotonic() - start < 1.5
        task.cancel()

    asyncio.run(main())
