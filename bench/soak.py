"""Soak: mixed traffic against a real server for a while, with its memory split by component after each phase.

    .venv/bin/python bench/soak.py --duration 180 [--phases 6] [--concurrency 4] [--url http://...]
        [-- extra serve flags]

Without --url it starts `metalserve serve` (the embedded default model) on a free port and stops it at
the end. The traffic, drawn at random in every worker: JSON-schema answers (each request its own small
schema, so the grammar cache fills and evicts), tool calls (auto, required, named), Responses with 16
keys of 512-character metadata chained through previous_response_id, and aborts (streams dropped after
a few events, non-streamed requests given up on). After each phase it reads GET /debug/memory: resident
memory as weights, KV pool, grammar cache, Responses store and other. It prints start against end and
the growth beyond the KV pool's own (the target: under 10 % of the starting resident set).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import time
from typing import Any

import httpx

COLUMNS = ("rss", "weights", "kv_pool", "grammar_cache", "responses_store", "other")
HEADERS = {"grammar_cache": "grammars", "responses_store": "store"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]},
        },
    },
]


class Traffic:
    """One kind of request per call, chosen at random; counts what came back."""

    def __init__(self, client: httpx.AsyncClient, model: str, rng: random.Random) -> None:
        self.client, self.model, self.rng = client, model, rng
        self.counts: dict[str, int] = {}
        self.last_response_id: str | None = None

    def _count(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1

    async def one(self) -> None:
        kind = self.rng.choice(("schema", "schema", "tools", "responses", "responses", "abort_stream", "abort_wait"))
        try:
            await getattr(self, kind)()
        except httpx.HTTPError as exc:
            self._count(f"{kind}:{type(exc).__name__}")

    def _messages(self, text: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": text}]

    async def schema(self) -> None:
        n = self.rng.randrange(1_000_000)  # a new schema nearly every time: the grammar cache churns
        schema = {
            "type": "object",
            "properties": {
                f"field_{n}": {"type": "string", "maxLength": 8 + n % 16},
                "count": {"type": "integer", "minimum": 0, "maximum": n},
            },
            "required": [f"field_{n}", "count"],
            "additionalProperties": False,
        }
        body = {
            "model": self.model,
            "messages": self._messages("Describe a city as JSON."),
            "max_tokens": 24,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        }
        response = await self.client.post("/v1/chat/completions", json=body)
        self._count(f"schema:{response.status_code}")

    async def tools(self) -> None:
        choice = self.rng.choice(["auto", "required", {"type": "function", "function": {"name": "get_time"}}])
        body = {
            "model": self.model,
            "messages": self._messages("Weather in Paris?"),
            "tools": TOOLS,
            "tool_choice": choice,
            "max_tokens": 24,
        }
        response = await self.client.post("/v1/chat/completions", json=body)
        self._count(f"tools:{response.status_code}")

    async def responses(self) -> None:
        metadata = {f"key_{i}_{self.rng.randrange(10**6)}": self.rng.choice("abcdef") * 512 for i in range(16)}
        body: dict[str, Any] = {
            "model": self.model,
            "input": "Say hello.",
            "max_output_tokens": 16,
            "metadata": metadata,
        }
        if self.last_response_id is not None and self.rng.random() < 0.5:
            body["previous_response_id"] = self.last_response_id
        response = await self.client.post("/v1/responses", json=body)
        if response.status_code == 200:
            self.last_response_id = response.json()["id"]
        elif response.status_code == 400:
            self.last_response_id = None  # evicted from the store: start a new chain
        self._count(f"responses:{response.status_code}")

    async def abort_stream(self) -> None:
        body = {
            "model": self.model,
            "messages": self._messages("Tell a long story."),
            "max_tokens": 200,
            "stream": True,
        }
        async with self.client.stream("POST", "/v1/chat/completions", json=body) as response:
            n = 0
            async for _ in response.aiter_lines():
                n += 1
                if n > 4:
                    break
        self._count("abort_stream")

    async def abort_wait(self) -> None:
        body = {"model": self.model, "prompt": "Once upon a time", "max_tokens": 200}
        with contextlib.suppress(httpx.TimeoutException):  # the client gives up: the server aborts it
            await self.client.post("/v1/completions", json=body, timeout=0.5)
        self._count("abort_wait")


async def memory(client: httpx.AsyncClient) -> dict[str, int]:
    return dict((await client.get("/debug/memory")).json())


async def run(url: str, duration: float, phases: int, concurrency: int, seed: int) -> list[tuple[str, dict[str, int]]]:
    rows: list[tuple[str, dict[str, int]]] = []
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        rows.append(("cold", await memory(client)))
        print(_row(*rows[-1]), flush=True)
        workers = [Traffic(client, model, random.Random(seed + i)) for i in range(concurrency)]
        # Warm-up: one of each kind, so first-use costs (llguidance's tokenizer, MLX's buffers) are not growth.
        for kind in ("schema", "tools", "responses", "abort_stream", "abort_wait"):
            await getattr(workers[0], kind)()
        rows.append(("start", await memory(client)))
        print(_row(*rows[-1]), flush=True)
        for phase in range(phases):
            end = time.monotonic() + duration / phases

            async def work(traffic: Traffic, end: float = end) -> None:
                while time.monotonic() < end:
                    await traffic.one()

            await asyncio.gather(*(work(t) for t in workers))
            rows.append((f"phase {phase + 1}", await memory(client)))
            print(_row(*rows[-1]), flush=True)
        await asyncio.sleep(5)  # idle: aborted requests are gone, caches stay
        rows.append(("idle", await memory(client)))
        print(_row(*rows[-1]), flush=True)
        counts: dict[str, int] = {}
        for traffic in workers:
            for key, value in traffic.counts.items():
                counts[key] = counts.get(key, 0) + value
        print("requests:", json.dumps(dict(sorted(counts.items()))))
    return rows


def _mb(value: int) -> str:
    return f"{value / 2**20:10.2f}"


def _row(name: str, report: dict[str, int]) -> str:
    return f"{name:>9} " + " ".join(_mb(report.get(c, 0)) for c in COLUMNS)


def start_server(flags: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    defaults = ["--max-model-len", "2048", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    cmd = [
        sys.executable,
        "-m",
        "metalserve.cli",
        "serve",
        "--port",
        str(port),
        "--log-stats-interval",
        "0",
        *defaults,
        *flags,
    ]
    log = open(os.devnull, "wb")  # noqa: SIM115
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    process.terminate()
    raise SystemExit("the server did not become healthy in time")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of traffic in all (1800: the long run)")
    parser.add_argument("--phases", type=int, default=6, help="memory is read after each")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", default=None, help="a running server (needs GET /debug/memory); else one is started")
    parser.add_argument("serve_flags", nargs="*", help="extra `metalserve serve` flags (after --)")
    args = parser.parse_args()
    process = None
    url = args.url
    if url is None:
        process, url = start_server(args.serve_flags)
    try:
        print(f"{'MiB':>9} " + " ".join(f"{HEADERS.get(c, c):>10}" for c in COLUMNS))
        rows = asyncio.run(run(url, args.duration, args.phases, args.concurrency, args.seed))
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=60)
    (_, start), (_, end) = rows[1], rows[-1]
    print(_row("start", start))
    print(_row("end", end))
    growth = (end["rss"] - end["kv_pool"]) - (start["rss"] - start["kv_pool"])
    print(
        f"RSS growth beyond the KV pool's own: {growth / 2**20:.1f} MiB = {100 * growth / start['rss']:.1f} % "
        f"of the starting {start['rss'] / 2**20:.1f} MiB (target: under 10 %)"
    )


if __name__ == "__main__":
    main()
