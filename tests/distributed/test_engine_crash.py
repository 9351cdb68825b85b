"""AsyncEngine.crash: the pipeline watchdog's way in. Open requests fail, `on_dead` runs (the server then
exits 1), new requests are refused; also when the engine thread was idle or not started yet."""

from __future__ import annotations

import asyncio
import threading

import pytest

from metalserve.engine.async_engine import AsyncEngine, EngineDeadError
from metalserve.sampling_params import SamplingParams
from tests.api.fakes import FakeCore, tiny_tokenizer


def _engine(core: FakeCore) -> tuple[AsyncEngine, threading.Event]:
    engine = AsyncEngine(core, core.tokenizer, model_name="tiny", max_model_len=128, eos_token_ids={2})
    dead = threading.Event()
    engine.on_dead = dead.set
    return engine, dead


def test_crash_fails_a_running_stream() -> None:
    async def main() -> None:
        engine, dead = _engine(FakeCore(tiny_tokenizer(), "word " * 200, step_delay=0.01))
        prompt = list(tiny_tokenizer().encode("hello", add_special_tokens=False))
        got = 0
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate(prompt, SamplingParams(max_tokens=150), "r"):
                got += 1
                if got == 3:
                    engine.crash(RuntimeError("pipeline rank 1 exited with status -9"))
        assert dead.wait(5) and engine.dead_error is not None
        with pytest.raises(EngineDeadError):
            await anext(engine.generate(prompt, SamplingParams(max_tokens=2), "again"))

    asyncio.run(main())


def test_crash_before_any_request_still_kills_the_engine() -> None:
    engine, dead = _engine(FakeCore(tiny_tokenizer(), "x"))
    engine.crash(RuntimeError("pipeline rank 1 exited with status 1"))
    assert dead.wait(5)
    assert str(engine.dead_error) == "pipeline rank 1 exited with status 1"
