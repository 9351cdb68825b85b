"""`tool_choice: auto` requests get the lazy tool-call grammar through every chat-form API (fake core: it
checks the engine's params), unless --no-tool-call-grammar or another constraint says otherwise."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from metalserve.api.settings import ServerSettings
from tests.api.conftest import MODEL, Served, live, make_served

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
CALL = '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```'


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    with live(make_served(max_model_len=1024)) as served:
        yield served


def _spec(server: Served) -> Any:
    return server.core.added[-1].sampling_params.structured_outputs


def _chat(server: Served, **body: Any) -> dict[str, Any]:
    body = {"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": f"say:{CALL}"}], **body}
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def test_auto_chat_gets_the_lazy_grammar_and_the_fenced_call_is_read(server: Served) -> None:
    message = _chat(server, tools=TOOLS)["choices"][0]["message"]
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    spec = _spec(server)
    assert spec is not None and spec.grammar is not None
    assert "[lazy]" in spec.grammar and "get_weather" in spec.grammar


@pytest.mark.parametrize(
    "extra",
    [
        {"tool_choice": "none"},
        {"response_format": {"type": "json_object"}},
        {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    ],
)
def test_no_lazy_grammar_where_the_request_says_otherwise(server: Served, extra: dict[str, Any]) -> None:
    _chat(server, tools=TOOLS, **extra)
    spec = _spec(server)
    assert spec is None or spec.grammar is None


def test_a_schema_the_engine_refuses_leaves_the_request_unconstrained(
    server: Served, caplog: pytest.LogCaptureFixture
) -> None:
    bad = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "objec"}}}]
    message = _chat(server, tools=bad)["choices"][0]["message"]
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    assert _spec(server) is None
    assert "not constrained" in caplog.text


def test_messages_and_responses_get_it_too(server: Served) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    message = client.messages.create(
        model=MODEL,
        max_tokens=64,
        tools=[{"name": "get_weather", "input_schema": SCHEMA}],  # type: ignore[list-item]
        messages=[{"role": "user", "content": f"say:{CALL}"}],
    )
    assert message.stop_reason == "tool_use" and _spec(server).grammar is not None
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    response = oai.responses.create(
        model=MODEL,
        input=f"say:{CALL}",
        tools=[{"type": "function", "name": "get_weather", "parameters": SCHEMA, "strict": False}],
    )
    assert response.output[-1].type == "function_call" and _spec(server).grammar is not None


def test_the_flag_turns_it_off() -> None:
    settings = ServerSettings(
        tool_call_parser="hermes", enable_auto_tool_choice=True, log_stats_interval=0, tool_call_grammar=False
    )
    with live(make_served(settings, max_model_len=1024)) as served:
        message = _chat(served, tools=TOOLS)["choices"][0]["message"]
        assert message["tool_calls"][0]["function"]["name"] == "get_weather"  # the forgiving parser still reads it
        assert _spec(served) is None


def test_the_grammar_vocabulary_is_built_at_start_where_tool_calls_get_a_grammar() -> None:
    """So an agent's first request does not wait (or time out) for it; not built when nothing needs it."""
    compiler = make_served().engine._grammar
    assert compiler is not None and compiler._tokenizer_future is not None
    assert compiler._tokenizer_future.result(timeout=60) is not None
    off = ServerSettings(tool_call_parser="hermes", enable_auto_tool_choice=True, tool_call_grammar=False)
    assert make_served(off).engine._grammar is None


def test_the_prompt_renders_the_tools_as_the_client_wrote_them(server: Served) -> None:
    """No `"description": null` / `"strict": null` for fields the client left out; a schema's own nulls stay."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "default": None}}}
    _chat(server, tools=[{"type": "function", "function": {"name": "get_weather", "parameters": schema}}])
    prompt = server.core.tokenizer.decode(server.core.added[-1].prompt_token_ids)
    rendered = '{"type": "function", "function": {"name": "get_weather", "parameters": ' + json.dumps(schema) + "}}"
    assert rendered in prompt, prompt
