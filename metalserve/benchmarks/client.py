"""One streamed request to an OpenAI-compatible server, timed (httpx, async)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from metalserve.benchmarks.stream import StreamError, StreamTimer

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}

Message = dict[str, str]


def endpoint_path(endpoint: str) -> str:
    """`chat`, `completions`, or an explicit path such as `/v1/completions`."""
    if endpoint in ENDPOINTS:
        return ENDPOINTS[endpoint]
    if endpoint.endswith("/chat/completions") or endpoint.endswith("/completions"):
        return endpoint if endpoint.startswith("/") else "/" + endpoint
    raise ValueError(f"--endpoint must be 'chat', 'completions' or a .../completions path, got {endpoint!r}")


def is_chat(path: str) -> bool:
    return path.endswith("/chat/completions")


def render_plain(messages: list[Message]) -> str:
    """Messages as one completions prompt: a lone user message is sent as is, else with role headers."""
    if len(messages) == 1 and messages[0]["role"] == "user":
        return messages[0]["content"]
    parts = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n\n".join(parts) + "\n\nAssistant:"


@dataclass(frozen=True)
class RequestSettings:
    """What every request of a run shares."""

    model: str
    path: str
    temperature: float = 0.0
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)


def build_payload(settings: RequestSettings, messages: list[Message], max_tokens: int) -> dict[str, Any]:
    """The JSON body: streaming with usage, so output token counts come from the server when it can."""
    body: dict[str, Any] = {
        "model": settings.model,
        "max_tokens": max_tokens,
        "temperature": settings.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if settings.ignore_eos:
        body["ignore_eos"] = True  # vLLM, metalserve and llama-server all read it; others ignore it
    if is_chat(settings.path):
        body["messages"] = messages
    else:
        body["prompt"] = render_plain(messages)
    body.update(settings.extra_body)
    return body


@dataclass
class RequestOutcome:
    """What one request measured. Times in seconds; `start` is on the perf_counter clock."""

    success: bool
    start: float
    latency: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    error: str = ""


async def send_request(
    client: httpx.AsyncClient,
    settings: RequestSettings,
    messages: list[Message],
    max_tokens: int,
    clock: Callable[[], float] = time.perf_counter,
) -> RequestOutcome:
    """Send one streaming request; any failure becomes `success=False` with the reason, never an exception."""
    payload = build_payload(settings, messages, max_tokens)
    start = clock()
    timer = StreamTimer(start=start)
    try:
        async with client.stream("POST", settings.path, json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                return RequestOutcome(False, start, clock() - start, error=f"HTTP {resp.status_code}: {body[:300]}")
            async for line in resp.aiter_lines():
                if not timer.feed_line(clock(), line):
                    break
    except (httpx.HTTPError, StreamError, OSError) as exc:
        return RequestOutcome(False, start, clock() - start, error=f"{type(exc).__name__}: {exc}")
    latency = clock() - start
    if timer.num_text_chunks == 0:
        return RequestOutcome(False, start, latency, error="the stream carried no generated text")
    return RequestOutcome(
        True, start, latency, timer.ttft, timer.itl, timer.text, timer.completion_tokens, timer.prompt_tokens
    )
