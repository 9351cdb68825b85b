"""A tiny OpenAI-compatible streaming server with known delays, run in a thread on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


@dataclass
class FakeBehaviour:
    """What the fake server does: delays, whether it reports usage, and which prompts fail."""

    ttft_s: float = 0.05
    itl_s: float = 0.01
    send_usage: bool = True
    role_chunk: bool = True  # chat: an empty role chunk first, as vLLM sends
    fail_marker: str = "FAIL"  # prompts containing it get HTTP 500
    bodies: list[dict[str, Any]] = field(default_factory=list)


def _prompt_text(body: dict[str, Any]) -> str:
    if "messages" in body:
        return " ".join(m["content"] for m in body["messages"])
    return str(body["prompt"])


async def _events(body: dict[str, Any], chat: bool, b: FakeBehaviour) -> AsyncIterator[str]:
    n = int(body["max_tokens"])
    if chat and b.role_chunk:
        yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        yield "\n\n"
    for i in range(n):
        await asyncio.sleep(b.ttft_s if i == 0 else b.itl_s)
        choice = {"index": 0, "delta": {"content": "tok "}} if chat else {"index": 0, "text": "tok "}
        yield "data: " + json.dumps({"choices": [choice]}) + "\n\n"
    if b.send_usage:
        usage = {"prompt_tokens": len(_prompt_text(body).split()), "completion_tokens": n}
        yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
    yield "data: [DONE]\n\n"


def make_app(b: FakeBehaviour) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/tokenize")
    async def tokenize(req: Request) -> dict[str, Any]:
        text = (await req.json())["prompt"]
        return {"tokens": list(range(len(text.split())))}  # one token per word

    async def generate(req: Request, chat: bool) -> Any:
        body = await req.json()
        b.bodies.append(body)
        if b.fail_marker in _prompt_text(body):
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        return StreamingResponse(_events(body, chat, b), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: Request) -> Any:
        return await generate(req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(req: Request) -> Any:
        return await generate(req, chat=True)

    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FakeServer:
    """Context manager: serves `make_app(behaviour)` in a background thread; `.url` is its root."""

    def __init__(self, behaviour: FakeBehaviour) -> None:
        self.behaviour = behaviour
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(make_app(behaviour), host="127.0.0.1", port=self.port, log_level="warning")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> FakeServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the fake server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
