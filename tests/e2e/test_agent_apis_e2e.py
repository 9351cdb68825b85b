"""The Anthropic Messages and OpenAI Responses APIs on the real server and the default model, driven by the
official `anthropic` and `openai` SDKs. One quick test per API runs by default; the rest are slow."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.e2e.server import RunningServer, running_server

QUESTION = "What is the capital of France?"
GREEDY = {"temperature": 0}
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": CITY}]


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    flags = (
        "--max-model-len",
        "2048",
        "--kv-cache-memory",
        str(96 << 20),
        "--tool-call-parser",
        "hermes",
        "--enable-auto-tool-choice",
    )
    with running_server(*flags) as s:
        yield s


@pytest.fixture(scope="module")
def claude(server: RunningServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", timeout=300, max_retries=0)


@pytest.fixture(scope="module")
def oai(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", timeout=300, max_retries=0)


def test_messages_quick(claude: anthropic.Anthropic, server: RunningServer) -> None:
    ask: list[Any] = [{"role": "user", "content": QUESTION}]
    whole = claude.messages.create(model=server.model, max_tokens=12, messages=ask, extra_body=GREEDY)
    assert "Paris" in whole.content[0].text  # type: ignore[union-attr]
    with claude.messages.stream(model=server.model, max_tokens=12, messages=ask, extra_body=GREEDY) as stream:
        names = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text  # type: ignore[union-attr]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names.index("content_block_start") < names.index("content_block_stop")
    counted = claude.messages.count_tokens(model=server.model, messages=ask).input_tokens
    usage = final.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == counted
    assert (usage.cache_read_input_tokens or 0) > 0  # the same prompt ran just before


def test_responses_quick(oai: openai.OpenAI, server: RunningServer) -> None:
    whole = oai.responses.create(model=server.model, input=QUESTION, max_output_tokens=12, temperature=0)
    assert "Paris" in whole.output_text
    with oai.responses.stream(model=server.model, input=QUESTION, max_output_tokens=12, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert oai.responses.retrieve(final.id).output_text == whole.output_text
    assert final.usage is not None and final.usage.input_tokens_details.cached_tokens > 0


@pytest.mark.slow
def test_messages_five_turns_cache_grows(claude: anthropic.Anthropic, server: RunningServer) -> None:
    history: list[Any] = []
    cached = []
    for turn in range(5):
        history.append({"role": "user", "content": f"Turn {turn}: name a fruit and a colour."})
        reply = claude.messages.create(
            model=server.model, max_tokens=16, system="You are a terse assistant.", messages=history, extra_body=GREEDY
        )
        cached.append(reply.usage.cache_read_input_tokens or 0)
        history.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
    assert all(b > a for a, b in zip(cached, cached[1:], strict=False)), cached


@pytest.mark.slow
def test_responses_five_turns_cache_grows(oai: openai.OpenAI, server: RunningServer) -> None:
    previous, cached = None, []
    for turn in range(5):
        reply = oai.responses.create(
            model=server.model,
            input=f"Turn {turn}: name a fruit and a colour.",
            instructions="You are a terse assistant.",
            previous_response_id=previous,
            max_output_tokens=16,
            temperature=0,
        )
        assert reply.usage is not None
        cached.append(reply.usage.input_tokens_details.cached_tokens)
        previous = reply.id
    assert all(b > a for a, b in zip(cached, cached[1:], strict=False)), cached


@pytest.mark.slow
def test_tool_history_renders_on_the_real_template(claude: anthropic.Anthropic, server: RunningServer) -> None:
    history: list[Any] = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "22 C, sunny"}]},
    ]
    reply = claude.messages.create(model=server.model, max_tokens=16, messages=history, tools=TOOLS)  # type: ignore[arg-type]
    assert reply.content and reply.stop_reason in ("end_turn", "max_tokens", "tool_use")
    items: list[Any] = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "22 C, sunny"},
    ]
    tools: Any = [{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["input_schema"]}]
    response = oai_client(server).responses.create(model=server.model, input=items, tools=tools, max_output_tokens=16)
    assert response.output


def oai_client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", timeout=300, max_retries=0)


@pytest.mark.slow
def test_bad_input_is_a_4xx_and_the_server_goes_on(server: RunningServer) -> None:
    url = f"{server.base_url}/v1/messages"
    base: dict[str, Any] = {"model": server.model, "messages": [{"role": "user", "content": "Hi"}]}
    bad = [
        base,  # no max_tokens
        {**base, "max_tokens": 4, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
        {
            **base,
            "max_tokens": 4,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
                    ],
                }
            ],
        },
        {
            **base,
            "max_tokens": 4,
            "messages": [
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_unknown", "content": "x"}]}
            ],
        },
    ]
    for body in bad:
        response = httpx.post(url, json=body, timeout=60)
        assert response.status_code == 400 and response.json()["type"] == "error", response.text
    responses = httpx.post(
        f"{server.v1}/responses",
        json={"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]},
        timeout=60,
    )
    assert responses.status_code == 400 and "nope" in responses.json()["error"]["message"]
    ok = httpx.post(url, json={**base, "max_tokens": 4}, timeout=120)
    assert ok.status_code == 200 and json.loads(ok.text)["content"]


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_messages_forced_tool_use_round_trip(claude: anthropic.Anthropic, server: RunningServer, stream: bool) -> None:
    ask: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs: Any = {
        "model": server.model,
        "max_tokens": 48,
        "messages": ask,
        "tools": TOOLS,
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "extra_body": GREEDY,
    }
    if stream:
        with claude.messages.stream(**kwargs) as s:
            first = s.get_final_message()
    else:
        first = claude.messages.create(**kwargs)
    assert first.stop_reason == "tool_use"
    [use] = first.content
    assert use.type == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, CITY)
    history = [
        *ask,
        {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "22 C, sunny"}]},
    ]
    second = claude.messages.create(
        model=server.model,
        max_tokens=24,
        messages=history,
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "none"},
        extra_body=GREEDY,
    )
    assert second.stop_reason in ("end_turn", "max_tokens") and second.content[0].type == "text"
    assert (second.usage.cache_read_input_tokens or 0) > 0


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_responses_forced_function_call_round_trip(oai: openai.OpenAI, server: RunningServer, stream: bool) -> None:
    tools: Any = [{"type": "function", "name": "get_weather", "parameters": CITY, "strict": True}]
    kwargs: Any = {
        "model": server.model,
        "input": "What is the weather in Paris?",
        "tools": tools,
        # Named, not "required": with "required" this model repeats the call until max_output_tokens cuts it.
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 64,
        "temperature": 0,
    }
    if stream:
        with oai.responses.stream(**kwargs) as s:
            first = s.get_final_response()
    else:
        first = oai.responses.create(**kwargs)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), CITY)
    outputs: Any = [{"type": "function_call_output", "call_id": c.call_id, "output": "22 C, sunny"} for c in calls]
    second = oai.responses.create(
        model=server.model,
        previous_response_id=first.id,
        input=outputs,
        tools=tools,
        tool_choice="none",
        max_output_tokens=24,
        temperature=0,
    )
    assert second.output_text and second.usage is not None
    assert second.usage.input_tokens_details.cached_tokens > 0


@pytest.mark.slow
def test_json_formats_validate(claude: anthropic.Anthropic, oai: openai.OpenAI, server: RunningServer) -> None:
    ask: Any = [{"role": "user", "content": "Name a city in France as JSON."}]
    message = claude.messages.create(
        model=server.model,
        max_tokens=48,
        messages=ask,
        extra_body=GREEDY,
        output_config={"format": {"type": "json_schema", "schema": CITY}},
    )
    jsonschema.validate(json.loads(message.content[0].text), CITY)  # type: ignore[union-attr]
    text: Any = {"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}}
    response = oai.responses.create(
        model=server.model, input="Name a city in France as JSON.", text=text, max_output_tokens=48, temperature=0
    )
    jsonschema.validate(json.loads(response.output_text), CITY)
