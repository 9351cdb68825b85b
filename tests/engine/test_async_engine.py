"""The asyncio front: streaming through queues, stop strings, aborts, core failure, thread ownership."""

from __future__ import annotations

import asyncio
import threading

import pytest

from metalserve.engine.async_engine import AsyncEngine, EngineDeadError, IterationStats, RequestOutput
from metalserve.engine.protocol import SchedulerStatsLike
from metalserve.sampling_params import SamplingParams
from tests.api.fakes import FakeCore, tiny_tokenizer

REPLY = "Hello world! caf\u00e9 \U0001f600 The end."


class _Observer:
    def __init__(self) -> None:
        self.iterations: list[IterationStats] = []
        self.last: SchedulerStatsLike | None = None

    def on_step(self, scheduler_stats: SchedulerStatsLike, iteration: IterationStats) -> None:
        self.last = scheduler_stats
        self.iterations.append(iteration)


def _engine(core: FakeCore, observer: _Observer | None = None) -> AsyncEngine:
    return AsyncEngine(core, core.tokenizer, model_name="tiny", max_model_len=128, eos_token_ids={2}, observer=observer)


def _prompt() -> list[int]:
    return list(tiny_tokenizer().encode("The capital of France", add_special_tokens=False))


async def _collect(engine: AsyncEngine, params: SamplingParams, rid: str = "r") -> list[RequestOutput]:
    return [out async for out in engine.generate(_prompt(), params, rid)]


def test_stream_reassembles_reply_and_core_stays_on_one_thread() -> None:
    async def main() -> None:
        core = FakeCore(tiny_tokenizer(), REPLY)
        observer = _Observer()
        engine = _engine(core, observer)
        outs = await _collect(engine, SamplingParams(max_tokens=100))
        await engine.shutdown()
        assert "".join(o.text for o in outs) == REPLY
        assert outs[-1].finish_reason == "stop" and outs[-1].finished
        assert sum(len(o.token_ids) for o in outs) == outs[-1].num_output_tokens
        assert outs[-1].num_prompt_tokens == len(_prompt())
        assert core.threads and threading.get_ident() not in core.threads and len(core.threads) == 1
        assert sum(it.num_generation_tokens for it in observer.iterations) == outs[-1].num_output_tokens
        assert sum(len(it.time_to_first_tokens) for it in observer.iterations) == 1
        assert [f[0] for it in observer.iterations for f in it.finished] == ["stop"]

    asyncio.run(main())


def test_length_limit() -> None:
    async def main() -> None:
        engine = _engine(FakeCore(tiny_tokenizer(), REPLY))
        outs = await _collect(engine, SamplingParams(max_tokens=3))
        await engine.shutdown()
        assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 3

    asyncio.run(main())


def test_stop_string_finishes_request_in_core() -> None:
    async def main() -> None:
        core = FakeCore(tiny_tokenizer(), REPLY)
        engine = _engine(core)
        outs = await _collect(engine, SamplingParams(max_tokens=100, stop=["caf\u00e9"]))
        await engine.shutdown()
        assert "".join(o.text for o in outs) == "Hello world! "
        assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == "caf\u00e9"
        assert core.finished_by_frontend == ["r"] and core.used_blocks == 0

    asyncio.run(main())


def test_closing_the_stream_aborts_and_frees_blocks() -> None:
    async def main() -> None:
        core = FakeCore(tiny_tokenizer(), REPLY, step_delay=0.01)
        engine = _engine(core)
        stream = engine.generate(_prompt(), SamplingParams(max_tokens=100, ignore_eos=True), "gone")
        first = await stream.__anext__()
        assert first.token_ids
        await stream.aclose()
        for _ in range(200):
            if not core.running:
                break
            await asyncio.sleep(0.01)
        assert core.aborted == ["gone"] and core.used_blocks == 0
        # The engine goes on serving.
        outs = await _collect(engine, SamplingParams(max_tokens=4), "next")
        assert outs[-1].finish_reason == "length"
        await engine.shutdown()

    asyncio.run(main())


def test_event_loop_stays_responsive_during_slow_steps() -> None:
    async def main() -> None:
        core = FakeCore(tiny_tokenizer(), REPLY, step_delay=0.05)
        engine = _engine(core)
        task = asyncio.create_task(_collect(engine, SamplingParams(max_tokens=6)))
        ticks = 0
        while not task.done():
            await asyncio.sleep(0.005)
            ticks += 1
        await engine.shutdown()
        # Six steps of 50 ms each; a loop blocked by the forward would tick about six times.
        assert ticks > 20

    asyncio.run(main())


def test_core_failure_fails_requests_and_marks_engine_dead() -> None:
    async def main() -> None:
        engine = _engine(FakeCore(tiny_tokenizer(), REPLY, fail_after_steps=2))
        with pytest.raises(EngineDeadError):
            await _collect(engine, SamplingParams(max_tokens=50))
        assert engine.dead_error is not None and not engine.is_running
        with pytest.raises(EngineDeadError):
            await _collect(engine, SamplingParams(max_tokens=5), "again")

    asyncio.run(main())


def test_duplicate_request_id_rejected_and_concurrent_requests_separate() -> None:
    async def main() -> None:
        engine = _engine(FakeCore(tiny_tokenizer(), REPLY, step_delay=0.005))
        a = asyncio.create_task(_collect(engine, SamplingParams(max_tokens=100), "a"))
        await asyncio.sleep(0.02)
        with pytest.raises(ValueError, match="already running"):
            await _collect(engine, SamplingParams(), "a")
        b = await _collect(engine, SamplingParams(max_tokens=100), "b")
        assert "".join(o.text for o in await a) == REPLY == "".join(o.text for o in b)
        await engine.shutdown()

    asyncio.run(main())


def test_request_refused_by_core_fails_alone() -> None:
    class _Refusing(FakeCore):
        def add_request(self, request):  # type: ignore[no-untyped-def]
            if request.request_id == "bad":
                raise ValueError("prompt too long")
            super().add_request(request)

    async def main() -> None:
        engine = _engine(_Refusing(tiny_tokenizer(), REPLY))
        with pytest.raises(ValueError, match="too long"):
            await _collect(engine, SamplingParams(), "bad")
        outs = await _collect(engine, SamplingParams(max_tokens=2), "good")
        assert outs[-1].finish_reason == "length" and engine.is_running
        await engine.shutdown()

    asyncio.run(main())
