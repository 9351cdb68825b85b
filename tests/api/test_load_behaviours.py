"""Behaviours under load that must keep holding: disconnect storms free everything, a stalled reader
blocks no one, and a soak leaves no state or memory behind."""

from __future__ import annotations

import asyncio
import gc
import time
import tracemalloc
from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.api.conftest import Served, live, make_served

STREAM = {"prompt": "Hi", "stream": True, "ignore_eos": True, "max_tokens": 200}


@pytest.fixture()
def slow() -> Iterator[Served]:
    with live(make_served(step_delay=0.005)) as served:
        yield served


async def _read_a_little(client: httpx.AsyncClient, url: str, events: int) -> None:
    async with client.stream("POST", f"{url}/v1/completions", json=STREAM) as response:
        n = 0
        async for line in response.aiter_lines():
            n += line.startswith("data: ")
            if n >= events:
                return  # leaving the block closes the connection mid-stream


def _wait_for(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_a_disconnect_storm_frees_everything(slow: Served) -> None:
    async def storm() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            await asyncio.gather(*(_read_a_little(client, slow.url, 2 + i % 5) for i in range(24)))

    asyncio.run(storm())
    _wait_for(lambda: not slow.core.running and slow.engine.num_active_requests == 0)
    assert len(slow.core.aborted) == 24 and slow.core.used_blocks == 0


def test_a_stalled_reader_does_not_hold_up_the_others(slow: Served) -> None:
    async def main() -> None:
        async with (
            httpx.AsyncClient(timeout=30) as client,
            client.stream("POST", f"{slow.url}/v1/completions", json=STREAM) as stalled,
        ):
            assert stalled.status_code == 200  # ... and never read from here on
            loop = asyncio.get_running_loop()
            start = loop.time()
            quick = await client.post(f"{slow.url}/v1/completions", json={"prompt": "say:done", "max_tokens": 5})
            assert quick.json()["choices"][0]["text"] == "done"
            assert loop.time() - start < 5

    asyncio.run(main())


def test_a_soak_of_300_requests_leaves_no_state_or_memory_behind() -> None:
    with live(make_served()) as served:

        async def burst(client: httpx.AsyncClient, n: int) -> None:
            bodies = [
                {"prompt": f"say:r{i}", "max_tokens": 4, "stream": i % 2 == 0, "cache_salt": f"t{i % 3}"}
                for i in range(n)
            ]
            responses = await asyncio.gather(*(client.post(f"{served.url}/v1/completions", json=b) for b in bodies))
            assert all(r.status_code == 200 for r in responses)

        async def soak() -> tuple[int, int]:
            async with httpx.AsyncClient(timeout=60) as client:
                await burst(client, 100)  # warm caches and pools first
                gc.collect()
                before = tracemalloc.get_traced_memory()[0]
                for _ in range(4):
                    await burst(client, 50)
                gc.collect()
                return before, tracemalloc.get_traced_memory()[0]

        tracemalloc.start()
        try:
            before, after = asyncio.run(soak())
        finally:
            tracemalloc.stop()
        assert not served.core.running and served.engine.num_active_requests == 0
        assert served.engine._states == {}
        assert after - before < 2 * 1024 * 1024, (before, after)
