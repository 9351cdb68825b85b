"""32 overlapping streams against a KV pool too small for all of them: all finish, all correct, pool freed."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.e2e.server import RunningServer, running_server

pytestmark = pytest.mark.slow
TOPICS = ["the sea", "a mountain", "bread", "a violin", "winter", "a library", "rain", "a garden"]
MAX_TOKENS = 8


async def stream_text(client: httpx.AsyncClient, server: RunningServer, prompt: str) -> str:
    body = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    parts = []
    async with client.stream("POST", f"{server.v1}/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                parts.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(parts)


def test_32_streams_on_a_small_pool_all_complete_correctly() -> None:
    prompts = [f"Write one sentence about {t}. Sentence {i}:" for i in range(4) for t in TOPICS]
    # 24 usable blocks of 16 tokens hold ~16 of these requests at once, not 32.
    per_block = 30 * 2 * 3 * 64 * 4 * 16
    flags = ["--max-model-len", "256", "--kv-cache-memory", str(25 * per_block), "--no-enable-prefix-caching"]
    with running_server(*flags) as server:
        most_waiting = 0.0

        async def watch_waiting(client: httpx.AsyncClient) -> None:
            nonlocal most_waiting
            while True:
                text = (await client.get(f"{server.base_url}/metrics")).text
                for line in text.splitlines():
                    if line.startswith("vllm:num_requests_waiting{"):
                        most_waiting = max(most_waiting, float(line.rsplit(" ", 1)[1]))
                await asyncio.sleep(0.2)

        async def run_all() -> tuple[list[str], list[str]]:
            async with httpx.AsyncClient(timeout=600) as client:
                watcher = asyncio.create_task(watch_waiting(client))
                together = await asyncio.gather(*(stream_text(client, server, p) for p in prompts))
                watcher.cancel()
                alone = [await stream_text(client, server, p) for p in prompts]
            return list(together), alone

        together, alone = asyncio.run(run_all())
        # Every one of the 32 overlapped streams equals the same prompt's greedy text run alone.
        assert together == alone
        assert all(len(text) > 0 for text in together)
        assert server.metric("vllm:num_preemptions_total") > 0 or most_waiting > 0
        assert server.metric("vllm:kv_cache_usage_perc") == 0.0
        assert server.metric("vllm:num_requests_running") == 0


def test_the_kv_pool_grows_under_load_on_the_default_model() -> None:
    # The pool starts at 256 blocks (4,096 tokens); six 900-token prompts at once need more, so it grows
    # while the host forward reads and writes it. Every text still equals its run alone.
    words = [f"{t.split()[-1]}{i}" for i, t in enumerate(TOPICS * 30)]
    prompts = [" ".join(words[j:] + words[:j]) + f" Summary {j}:" for j in range(6)]
    with running_server("--max-model-len", "2048") as server:

        async def run_all() -> tuple[list[str], list[str]]:
            async with httpx.AsyncClient(timeout=600) as client:
                together = await asyncio.gather(*(stream_text(client, server, p) for p in prompts))
                alone = [await stream_text(client, server, p) for p in prompts]
            return list(together), alone

        together, alone = asyncio.run(run_all())
        assert together == alone and all(together)
        tokens = httpx.post(f"{server.base_url}/tokenize", json={"prompt": prompts[0]}).json()["count"]
        assert 6 * tokens > 256 * 16  # more than the initial pool holds
