"""Streams outlive a long prefill: while the model is silent each API sends a real event of its own protocol
(never only a `ping` or an SSE comment, which Claude Code and Codex do not count; api/keepalive.py), and
the answer the SDKs assemble is unchanged. Real uvicorn server in a thread, a fake core whose steps are
slow (an injected delay standing in for a long prefill)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.api.conftest import MODEL, Served, live, make_served

HI = [{"role": "user", "content": "Hi"}]
INTERVAL = 0.05  # keep-alive seconds in these tests
STEP = 0.5  # seconds each fake engine step takes (the first one is the "prefill")
TOOLS = [
    {
        "name": "get_weather",
        "description": "weather",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]


@pytest.fixture
def slow() -> Iterator[Served]:
    mp = pytest.MonkeyPatch()
    mp.setattr("metalserve.api.keepalive.KEEPALIVE_SECONDS", INTERVAL)
    try:
        with live(make_served(step_delay=STEP)) as served:
            yield served
    finally:
        mp.undo()


def _events(served: Served, path: str, body: dict[str, Any]) -> list[tuple[float, str, Any]]:
    """(seconds since the request, event name, parsed data) of every SSE event, as they arrive."""
    out: list[tuple[float, str, Any]] = []
    start = time.monotonic()
    headers = {"anthropic-version": "2023-06-01"}
    with httpx.stream("POST", f"{served.url}{path}", json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200
        name = "message"
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
                out.append((time.monotonic() - start, name, data if data == "[DONE]" else json.loads(data)))
                name = "message"
    return out


def _before_output(events: list[tuple[float, str, Any]], is_output: Any) -> list[tuple[float, str, Any]]:
    first = next(i for i, e in enumerate(events) if is_output(e))
    return events[:first]


def _assert_steady(early: list[tuple[float, str, Any]]) -> None:
    """Several events arrived during the silent first step, none far apart."""
    assert len(early) >= 4, early
    gaps = [b[0] - a[0] for a, b in zip(early, early[1:], strict=False)]
    assert max(gaps) < STEP * 0.8, gaps
    assert early[-1][0] > STEP * 0.5  # they really came while the engine was still busy


def test_messages_stream_sends_text_deltas_not_only_pings(slow: Served) -> None:
    body = {"model": MODEL, "max_tokens": 3, "messages": HI, "stream": True}
    events = _events(slow, "/v1/messages", body)
    early = _before_output(events, lambda e: e[1] == "content_block_delta" and e[2]["delta"]["text"])
    _assert_steady(early)
    names = [e[1] for e in early]
    assert names[:2] == ["message_start", "content_block_start"]
    # Claude Code skips `ping` before it resets its idle timer: the keep-alives are empty text deltas.
    assert names.count("content_block_delta") >= 3 and "ping" not in names
    assert all(e[2]["delta"] == {"type": "text_delta", "text": ""} for e in early if e[1] == "content_block_delta")
    # The model's text goes on in that same block: one text block, as without keep-alives.
    starts = [e for e in events if e[1] == "content_block_start"]
    assert len(starts) == 1 and events[-1][1] == "message_stop"
    claude = anthropic.Anthropic(base_url=slow.url, api_key="x", max_retries=0)
    with claude.messages.stream(model=MODEL, max_tokens=3, messages=HI) as stream:  # type: ignore[arg-type]
        streamed = stream.get_final_message()
    plain = claude.messages.create(model=MODEL, max_tokens=3, messages=HI)  # type: ignore[arg-type]
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in plain.content]
    assert streamed.usage.input_tokens + (streamed.usage.cache_read_input_tokens or 0) > 0


def test_messages_keepalive_block_closes_before_a_tool_call() -> None:
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    mp = pytest.MonkeyPatch()
    mp.setattr("metalserve.api.keepalive.KEEPALIVE_SECONDS", INTERVAL)
    try:
        with live(make_served(step_delay=0.3, reply=call)) as served:
            body = {"model": MODEL, "max_tokens": 64, "messages": HI, "tools": TOOLS}
            events = _events(served, "/v1/messages", {**body, "stream": True})
            claude = anthropic.Anthropic(base_url=served.url, api_key="x", max_retries=0)
            with claude.messages.stream(**body) as stream:
                final = stream.get_final_message()
    finally:
        mp.undo()
    starts = [e[2] for e in events if e[1] == "content_block_start"]
    assert [s["content_block"]["type"] for s in starts] == ["text", "tool_use"]
    assert [s["index"] for s in starts] == [0, 1]
    assert [b.type for b in final.content] == ["text", "tool_use"] and final.content[0].text == ""  # type: ignore[union-attr]
    assert final.content[1].input == {"city": "Paris"} and final.stop_reason == "tool_use"  # type: ignore[union-attr]


def test_responses_stream_repeats_in_progress(slow: Served) -> None:
    instructions = "You are a coding agent. " * 4  # Codex sends ~10 KB: not repeated every 10 s
    tool = {"type": "function", "name": "shell", "description": "Run a command. " * 4, "parameters": {}}
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 3, "stream": True, "instructions": instructions}
    events = _events(slow, "/v1/responses", {**body, "tools": [tool]})
    early = _before_output(events, lambda e: e[1] == "response.output_item.added")
    _assert_steady(early)
    names = [e[1] for e in early]
    assert names[0] == "response.created" and set(names[1:]) == {"response.in_progress"}
    sequence = [e[2]["sequence_number"] for e in events]
    assert sequence == list(range(len(events)))
    assert all(e[2]["response"]["status"] == "in_progress" for e in early[1:])
    full = [e[2]["response"] for e in early[:2]]  # created and the first in_progress: the whole object
    assert all(r["instructions"] == instructions and r["tools"][0]["name"] == "shell" for r in full)
    repeats = [e[2]["response"] for e in early[2:]]
    saved = len(instructions) + len(tool["description"])
    assert repeats and all(len(json.dumps(r)) < len(json.dumps(full[0])) - saved for r in repeats)
    assert all(r["instructions"] is None and r["tools"] == [] and r["id"] == full[0]["id"] for r in repeats)
    assert set(repeats[0]) == set(full[0])  # every key the protocol requires is still there
    client = openai.OpenAI(base_url=f"{slow.url}/v1", api_key="x", max_retries=0)
    parsed = list(client.responses.create(model=MODEL, input="Hi", max_output_tokens=3, stream=True))
    assert parsed[-1].type == "response.incomplete"  # max_output_tokens ran out, as asked
    plain = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3)
    assert parsed[-1].response.output_text == plain.output_text != ""


def test_chat_stream_sends_empty_deltas(slow: Served) -> None:
    body = {"model": MODEL, "messages": HI, "max_tokens": 3, "stream": True}
    events = _events(slow, "/v1/chat/completions", body)
    early = _before_output(events, lambda e: e[2] != "[DONE]" and e[2]["choices"][0]["delta"].get("content"))
    _assert_steady(early)
    assert early[0][2]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e[2]["choices"][0]["delta"] == {"content": ""} for e in early[1:])
    client = openai.OpenAI(base_url=f"{slow.url}/v1", api_key="x", max_retries=0)
    chunks = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, stream=True)  # type: ignore[arg-type]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    plain = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3)  # type: ignore[arg-type]
    assert text == plain.choices[0].message.content != ""
