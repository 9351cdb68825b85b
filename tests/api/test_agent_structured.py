"""Forced tool calls and structured outputs reach the grammar through Messages and Responses (fake core:
the reply is scripted, so this checks the translation, the engine's params and the rendering)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.api.conftest import MODEL, Served, live, make_served

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
A_TOOLS = [{"name": "get_weather", "input_schema": SCHEMA}, {"name": "get_time", "input_schema": {"type": "object"}}]
R_TOOLS = [{"type": "function", "name": "get_weather", "parameters": SCHEMA}]
REQUIRED = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    with live(make_served(max_model_len=1024)) as served:  # tools in the template make long prompts
        yield served


def _spec(server: Served) -> Any:
    return server.core.added[-1].sampling_params.structured_outputs


@pytest.mark.parametrize(
    ("choice", "reply"), [({"type": "tool", "name": "get_weather"}, '{"city": "Paris"}'), ({"type": "any"}, REQUIRED)]
)
@pytest.mark.parametrize("stream", [False, True])
def test_messages_forced_tool_use(server: Served, choice: dict[str, Any], reply: str, stream: bool) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    kwargs: Any = {
        "model": MODEL,
        "max_tokens": 64,
        "tools": A_TOOLS,
        "tool_choice": choice,
        "messages": [{"role": "user", "content": f"say:{reply}"}],
    }
    if stream:
        with client.messages.stream(**kwargs) as s:
            message = s.get_final_message()
    else:
        message = client.messages.create(**kwargs)
    assert message.stop_reason == "tool_use"
    [use] = message.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}  # type: ignore[union-attr]
    spec = _spec(server)
    expected = SCHEMA if choice["type"] == "tool" else None
    assert spec is not None and (expected is None or spec.json == expected)


def test_messages_output_config_format(server: Served) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 64,
        "messages": [{"role": "user", "content": 'say:{"city": "Oslo"}'}],
        "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
    }
    reply = httpx.post(f"{server.url}/v1/messages", json=body, timeout=30).json()
    assert json.loads(reply["content"][0]["text"]) == {"city": "Oslo"}
    assert _spec(server).json == {**SCHEMA, "additionalProperties": False}  # Anthropic's formats are strict
    bad = {**body, "output_config": {"format": {"type": "json_schema", "schema": {"type": "objec"}}}}
    error = httpx.post(f"{server.url}/v1/messages", json=bad, timeout=30)
    assert error.status_code == 400 and error.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("choice", [{"type": "function", "name": "get_weather"}, "required"])
@pytest.mark.parametrize("stream", [False, True])
def test_responses_forced_function_call(server: Served, choice: Any, stream: bool) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    reply = REQUIRED if choice == "required" else '{"city": "Paris"}'
    kwargs: Any = {"model": MODEL, "input": f"say:{reply}", "tools": R_TOOLS, "tool_choice": choice}
    if stream:
        with client.responses.stream(**kwargs) as s:
            response = s.get_final_response()
    else:
        response = client.responses.create(**kwargs)
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"} and _spec(server) is not None


def test_responses_text_format_json_schema(server: Served) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    text: Any = {"format": {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}}
    response = client.responses.create(model=MODEL, input='say:{"city": "Oslo"}', text=text)
    assert json.loads(response.output_text) == {"city": "Oslo"}
    assert _spec(server).json == {**SCHEMA, "additionalProperties": False}  # strict: no extra keys
    assert response.text.format.type == "json_schema"  # type: ignore[union-attr]
    client.responses.create(model=MODEL, input='say:{"a": 1}', text={"format": {"type": "json_object"}})
    assert _spec(server).json_object
