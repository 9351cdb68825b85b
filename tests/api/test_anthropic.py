"""The Anthropic Messages API over the fake core, through a real uvicorn server: httpx and the anthropic SDK."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import pytest

from metalserve.api.settings import ServerSettings
from tests.api.conftest import MODEL, Served, live, make_served
from tests.api.fakes import DEFAULT_REPLY

CALL = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"name": "get_weather", "description": "Weather for a city", "input_schema": {"type": "object"}}]
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def client(server: Served) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def _post(server: Served, path: str = "/v1/messages", **body: Any) -> httpx.Response:
    body.setdefault("messages", HI)
    return httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=30)


def _events(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) pairs; the name line and the data's own type must agree."""
    out, name = [], None
    for line in response.text.splitlines():
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            data = json.loads(line[len("data: ") :])
            assert data["type"] == name
            out.append((name, data))
    return out


def test_text_reply_with_usage(client: anthropic.Anthropic) -> None:
    message = client.messages.create(model=MODEL, max_tokens=64, messages=HI)  # type: ignore[arg-type]
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == DEFAULT_REPLY  # type: ignore[union-attr]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    counted = client.messages.count_tokens(model=MODEL, messages=HI)  # type: ignore[arg-type]
    usage = message.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == counted.input_tokens > 0
    assert usage.output_tokens > 0


def test_event_sequence_in_order(server: Served) -> None:
    events = _events(
        _post(
            server,
            max_tokens=64,
            stream=True,
            system="Be brief.",
            tools=TOOLS,
            messages=[{"role": "user", "content": f"say:{CALL}"}],
        )
    )
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    blocks = [d["content_block"]["type"] for n, d in events if n == "content_block_start"]
    assert blocks == ["text", "tool_use"]
    # Each block: start, deltas, stop, with its own index; never interleaved.
    body = names[2:-2]
    for index in (0, 1):
        mine = [n for n, d in events[2:-2] if d.get("index") == index]
        assert mine[0] == "content_block_start" and mine[-1] == "content_block_stop"
        assert set(mine[1:-1]) == {"content_block_delta"}
    assert len(body) == sum(1 for _, d in events[2:-2] if "index" in d)
    kinds = {d["delta"]["type"] for n, d in events if n == "content_block_delta"}
    assert kinds == {"text_delta", "input_json_delta"}
    partial = "".join(d["delta"]["partial_json"] for n, d in events if n == "content_block_delta" and d["index"] == 1)
    assert json.loads(partial) == {"city": "Paris"}
    end = events[-2][1]
    assert end["delta"] == {"stop_reason": "tool_use", "stop_sequence": None} and end["usage"]["output_tokens"] > 0
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0


def test_streamed_equals_non_streamed(client: anthropic.Anthropic) -> None:
    whole = client.messages.create(model=MODEL, max_tokens=64, messages=HI)  # type: ignore[arg-type]
    with client.messages.stream(model=MODEL, max_tokens=64, messages=HI) as stream:  # type: ignore[arg-type]
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == whole.usage.output_tokens


def _round_trip(client: anthropic.Anthropic, stream: bool) -> None:
    ask = [{"role": "user", "content": f"say:{CALL}"}]
    if stream:
        with client.messages.stream(model=MODEL, max_tokens=64, messages=ask, tools=TOOLS) as s:  # type: ignore[arg-type]
            first = s.get_final_message()
    else:
        first = client.messages.create(model=MODEL, max_tokens=64, messages=ask, tools=TOOLS)  # type: ignore[arg-type]
    assert first.stop_reason == "tool_use"
    [text, use] = first.content
    assert text.type == "text" and text.text.strip() == "Checking."  # type: ignore[union-attr]
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}  # type: ignore[union-attr]
    assert use.id.startswith("toolu_")  # type: ignore[union-attr]
    history = [
        *ask,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": "say:22 C and sunny"},  # type: ignore[union-attr]
            ],
        },
    ]
    second = client.messages.create(model=MODEL, max_tokens=64, messages=history, tools=TOOLS)  # type: ignore[arg-type]
    assert second.stop_reason == "end_turn" and second.content[0].text == "22 C and sunny"  # type: ignore[union-attr]


def test_tool_use_round_trip(client: anthropic.Anthropic) -> None:
    _round_trip(client, stream=False)


def test_tool_use_round_trip_streamed(client: anthropic.Anthropic) -> None:
    _round_trip(client, stream=True)


def test_tool_result_reaches_the_template(server: Served) -> None:
    history = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "22 C"}]},
                {"type": "text", "text": "Thanks"},
            ],
        },
    ]
    assert _post(server, max_tokens=4, messages=history, tools=TOOLS).status_code == 200
    prompt = server.engine.tokenizer.decode(server.core.added[-1].prompt_token_ids)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    assert "tool\n22 C" in prompt and "user\nThanks" in prompt


def test_stop_sequences_and_max_tokens(client: anthropic.Anthropic) -> None:
    ask = [{"role": "user", "content": "say:One two STOP three"}]
    stopped = client.messages.create(model=MODEL, max_tokens=64, messages=ask, stop_sequences=["STOP"])  # type: ignore[arg-type]
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "STOP"
    assert stopped.content[0].text == "One two "  # type: ignore[union-attr]
    cut = client.messages.create(model=MODEL, max_tokens=2, messages=HI)  # type: ignore[arg-type]
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2


def test_sampling_fields_reach_the_engine(server: Served) -> None:
    body = {
        "max_tokens": 3,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 7,
        "metadata": {"user_id": "u1"},
        "system": [{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}],
    }
    assert _post(server, **body).status_code == 200
    params = server.core.added[-1].sampling_params
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.5, 0.9, 7, 3)
    assert server.engine.tokenizer.decode(server.core.added[-1].prompt_token_ids).startswith("<|im_start|>system\nsys")


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
ERRORS: list[tuple[str, dict[str, Any], int, str]] = [
    ("no max_tokens", {"messages": HI}, 400, "max_tokens"),
    ("unknown field", {"max_tokens": 5, "messages": HI, "bogus": 1}, 400, "bogus"),
    ("image", {"max_tokens": 5, "messages": [{"role": "user", "content": [IMAGE]}]}, 400, "image"),
    (
        "unknown tool in tool_choice",
        {"max_tokens": 5, "messages": HI, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
        400,
        "nope",
    ),
    (
        "tool_result for an unknown id",
        {
            "max_tokens": 5,
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]},
            ],
        },
        400,
        "toolu_x",
    ),
    ("unknown model", {"model": "claude-nope", "max_tokens": 5, "messages": HI}, 404, "claude-nope"),
    (
        "server tool",
        {"max_tokens": 5, "messages": HI, "tools": [{"type": "web_search_20250305", "name": "w"}]},
        400,
        "",
    ),
    (
        "assistant prefill",
        {"max_tokens": 5, "messages": [*HI, {"role": "assistant", "content": "Sure"}]},
        400,
        "prefill",
    ),
    ("temperature above 1", {"max_tokens": 5, "messages": HI, "temperature": 1.5}, 400, "temperature"),
    (
        "thinking without a reasoning parser",
        {"max_tokens": 4096, "messages": HI, "thinking": {"type": "enabled", "budget_tokens": 1024}},
        400,
        "reasoning",
    ),
]


@pytest.mark.parametrize(("case", "body", "status", "needle"), ERRORS, ids=[c[0] for c in ERRORS])
def test_errors_in_anthropic_shape(server: Served, case: str, body: dict[str, Any], status: int, needle: str) -> None:
    response = _post(server, **body)
    assert response.status_code == status, response.text
    payload = response.json()
    assert set(payload) == {"type", "error"} and payload["type"] == "error"
    expected = "not_found_error" if status == 404 else "invalid_request_error"
    assert payload["error"]["type"] == expected and needle in payload["error"]["message"]
    assert _post(server, max_tokens=4).status_code == 200  # and the server goes on


def test_sdk_raises_typed_errors(client: anthropic.Anthropic, server: Served) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [IMAGE]}])  # type: ignore[list-item]
    assert "vision" in str(info.value)
    malformed = httpx.post(
        f"{server.url}/v1/messages/count_tokens", content="{nope", headers={"content-type": "application/json"}
    )
    assert malformed.status_code == 400 and malformed.json()["error"]["type"] == "invalid_request_error"


def test_cached_input_grows_over_five_turns(client: anthropic.Anthropic) -> None:
    history: list[dict[str, Any]] = [{"role": "user", "content": "say:Paris is sunny today. " * 3}]
    cached = []
    for turn in range(5):
        reply = client.messages.create(model=MODEL, max_tokens=16, system="You are terse.", messages=history)  # type: ignore[arg-type]
        cached.append(reply.usage.cache_read_input_tokens or 0)
        history += [
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]},
            {"role": "user", "content": f"say:turn {turn} ok"},
        ]
    assert all(b > a for a, b in zip(cached, cached[1:], strict=False)), cached


def test_x_api_key_and_bearer() -> None:
    with live(make_served(ServerSettings(api_key="sekrit", log_stats_interval=0))) as served:
        missing = httpx.post(f"{served.url}/v1/messages", json={"model": MODEL, "max_tokens": 3, "messages": HI})
        assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
        sdk = anthropic.Anthropic(base_url=served.url, api_key="sekrit", max_retries=0)  # sends x-api-key
        assert sdk.messages.create(model=MODEL, max_tokens=3, messages=HI).stop_reason == "max_tokens"  # type: ignore[arg-type]
        bearer = anthropic.Anthropic(base_url=served.url, auth_token="sekrit", max_retries=0)
        assert bearer.messages.count_tokens(model=MODEL, messages=HI).input_tokens > 0  # type: ignore[arg-type]
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=served.url, api_key="wrong", max_retries=0).messages.create(
                model=MODEL,
                max_tokens=3,
                messages=HI,  # type: ignore[arg-type]
            )
        assert httpx.get(f"{served.url}/v1/models", headers={"x-api-key": "sekrit"}).status_code == 200
