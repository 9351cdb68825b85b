"""Messages as Claude Code sends it, thinking blocks with a reasoning parser, and the hardening errors in
Anthropic's shape (fake core, real uvicorn server)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from metalserve.api.settings import ServerSettings
from tests.api.conftest import MODEL, Served, live, make_served
from tests.api.test_anthropic import HI, TOOLS, _events, _post


@pytest.fixture(scope="module")
def thinking_server() -> Iterator[Served]:
    settings = ServerSettings(
        tool_call_parser="hermes", enable_auto_tool_choice=True, reasoning_parser="qwen3", log_stats_interval=0
    )
    with live(make_served(settings)) as served:
        yield served


def test_thinking_blocks_streamed_and_not(thinking_server: Served) -> None:
    ask = [{"role": "user", "content": "say:<think>Paris is the capital.</think>\n\nParis."}]
    whole = _post(thinking_server, max_tokens=64, messages=ask).json()
    assert whole["content"] == [
        {"type": "thinking", "thinking": "Paris is the capital.", "signature": ""},
        {"type": "text", "text": "Paris."},
    ]
    events = _events(_post(thinking_server, max_tokens=64, messages=ask, stream=True))
    assert [d["content_block"]["type"] for n, d in events if n == "content_block_start"] == ["thinking", "text"]
    thought = "".join(d["delta"].get("thinking", "") for n, d in events if n == "content_block_delta")
    assert thought == "Paris is the capital."


def test_tool_fields_claude_code_sends(server: Served) -> None:
    tools = [{**TOOLS[0], "strict": True, "eager_input_streaming": True, "cache_control": {"type": "ephemeral"}}]
    reply = [{"type": "text", "text": "ok", "citations": None}]
    history = [*HI, {"role": "assistant", "content": reply}, {"role": "user", "content": "again"}]
    assert _post(server, max_tokens=3, messages=history, tools=tools).status_code == 200
    refused = _post(server, max_tokens=3, messages=HI, tools=[{**TOOLS[0], "input_examples": [{}]}])
    assert refused.status_code == 400 and "input_examples" in refused.json()["error"]["message"]


def test_what_claude_code_sends(server: Served) -> None:
    """System turns mid-conversation, deferred tools, context_management, adaptive thinking with display."""
    deferred = {"name": "Later", "input_schema": {"type": "object"}, "defer_loading": True}
    body = {
        "max_tokens": 3,
        "messages": [HI[0], {"role": "system", "content": [{"type": "text", "text": "Env: linux"}]}],
        "tools": [TOOLS[0], deferred],
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "metadata": {"user_id": '{"session_id": "s"}'},
    }
    assert _post(server, **body).status_code == 200
    prompt = server.engine.tokenizer.decode(server.core.added[-1].prompt_token_ids)
    assert "system\nEnv: linux" in prompt and "get_weather" in prompt and "Later" not in prompt
    forced = _post(server, **{**body, "tool_choice": {"type": "tool", "name": "Later"}})
    assert forced.status_code == 400 and "Later" in forced.json()["error"]["message"]
    other = {"edits": [{"type": "clear_tool_uses_20250919"}]}
    assert _post(server, **{**body, "context_management": other}).status_code == 400


def test_clear_thinking_keeps_the_last_turns() -> None:
    from metalserve.api.anthropic.protocol import CountTokensRequest
    from metalserve.api.anthropic.translate import to_chat

    def turn(i: int) -> list[dict[str, Any]]:
        thought = {"type": "thinking", "thinking": f"t{i}", "signature": ""}
        return [
            {"role": "user", "content": f"q{i}"},
            {"role": "assistant", "content": [thought, {"type": "text", "text": "a"}]},
        ]

    messages = [m for i in range(3) for m in turn(i)] + [{"role": "user", "content": "last"}]
    for keep, kept in (("all", ["t0", "t1", "t2"]), ({"type": "thinking_turns", "value": 2}, ["t1", "t2"])):
        edits = {"edits": [{"type": "clear_thinking_20251015", "keep": keep}]}
        req = CountTokensRequest(model=MODEL, messages=messages, context_management=edits)  # type: ignore[arg-type]
        chat = to_chat(req, reasoning=True)
        assert [m.reasoning_content for m in chat.messages if m.reasoning_content] == kept


def test_thinking_display_omitted(thinking_server: Served) -> None:
    ask = [{"role": "user", "content": "say:<think>secret</think>\n\nParis."}]
    thinking = {"type": "adaptive", "display": "omitted"}
    whole = _post(thinking_server, max_tokens=64, messages=ask, thinking=thinking).json()
    assert whole["content"][0] == {"type": "thinking", "thinking": "", "signature": ""}
    events = _events(_post(thinking_server, max_tokens=64, messages=ask, thinking=thinking, stream=True))
    assert [d["content_block"]["type"] for n, d in events if n == "content_block_start"] == ["thinking", "text"]
    assert "secret" not in json.dumps([d for _, d in events])


def test_hardening_errors_in_anthropic_shape(server: Served) -> None:
    raw = '{"model": "tiny-model", "max_tokens": 3, "messages": [{"role": "user", "content": "\\ud800"}]}'
    response = httpx.post(f"{server.url}/v1/messages", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["type"] == "error"
    assert "surrogate" in response.json()["error"]["message"]
    with live(make_served(ServerSettings(max_request_body_bytes=2048, log_stats_interval=0))) as small:
        big = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "x" * 5000}]}
        too_large = httpx.post(f"{small.url}/v1/messages", json=big)
        assert too_large.status_code == 413 and too_large.json()["error"]["type"] == "request_too_large"
        assert httpx.post(f"{small.url}/v1/chat/completions", json={"messages": big["messages"]}).json()["error"]
