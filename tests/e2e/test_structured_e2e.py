"""Structured outputs and forced tool calls on the real server and the default model, through the SDK."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from tests.e2e.server import RunningServer, running_server

pytestmark = pytest.mark.slow
ASK = [{"role": "user", "content": "Give the capital of France and its population as JSON."}]
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
    },
    "required": ["city", "population"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 30}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"tz": {"enum": ["UTC", "CET"]}},
                "required": ["tz"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    flags = (
        "--max-model-len",
        "2048",
        "--kv-cache-memory",
        str(96 << 20),
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    )
    with running_server(*flags) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", timeout=300)


def _text(client: openai.OpenAI, model: str, stream: bool, **kwargs: Any) -> tuple[str, str | None]:
    if not stream:
        choice = client.chat.completions.create(model=model, **kwargs).choices[0]
        return choice.message.content or "", choice.finish_reason
    text, reason = "", None
    for chunk in client.chat.completions.create(model=model, stream=True, **kwargs):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_validates(client: openai.OpenAI, server: RunningServer, stream: bool) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    text, reason = _text(client, server.model, stream, messages=ASK, response_format=fmt, max_tokens=60, temperature=0)
    assert reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
def test_json_object_output_is_an_object(client: openai.OpenAI, server: RunningServer, stream: bool) -> None:
    text, reason = _text(
        client,
        server.model,
        stream,
        messages=ASK,
        response_format={"type": "json_object"},
        max_tokens=120,
        temperature=0,
    )
    assert reason == "stop" and isinstance(json.loads(text), dict)


def test_choice_with_n_and_logprobs(client: openai.OpenAI, server: RunningServer) -> None:
    r = client.chat.completions.create(
        model=server.model,
        messages=ASK,
        n=3,
        temperature=1.0,
        seed=3,
        logprobs=True,
        top_logprobs=2,
        max_tokens=10,
        extra_body={"structured_outputs": {"choice": ["Paris", "Lyon", "Marseille"]}},
    )
    for choice in r.choices:
        assert choice.message.content in ("Paris", "Lyon", "Marseille") and choice.finish_reason == "stop"
        assert choice.logprobs and choice.logprobs.content


@pytest.mark.parametrize("stream", [False, True])
def test_regex_on_completions(client: openai.OpenAI, server: RunningServer, stream: bool) -> None:
    regex = {"structured_outputs": {"regex": " ?[0-9]{4}"}}
    kwargs: dict[str, Any] = dict(
        model=server.model,
        prompt="The Eiffel tower was built in the year",
        max_tokens=10,
        temperature=0,
        extra_body=regex,
    )
    if stream:
        text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    else:
        text = client.completions.create(**kwargs).choices[0].text
    assert re.fullmatch(r" ?[0-9]{4}", text)


def test_regex_with_a_stop_string(client: openai.OpenAI, server: RunningServer) -> None:
    r = client.chat.completions.create(
        model=server.model,
        messages=ASK,
        max_tokens=20,
        temperature=0,
        stop=["-"],
        extra_body={"structured_outputs": {"regex": "[a-z]{2,5}-[0-9]{3}"}},
    )
    assert re.fullmatch("[a-z]{2,5}", r.choices[0].message.content or "") and r.choices[0].finish_reason == "stop"


def _check_calls(calls: list[Any], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_have_valid_arguments(client: openai.OpenAI, server: RunningServer, tool_choice: Any) -> None:
    names = set(SCHEMAS) if tool_choice == "required" else {"get_time"}
    r = client.chat.completions.create(
        model=server.model, messages=WEATHER, tools=TOOLS, tool_choice=tool_choice, max_tokens=80, temperature=0
    )
    assert r.choices[0].finish_reason == "tool_calls"
    _check_calls(r.choices[0].message.tool_calls or [], names)
    with client.chat.completions.stream(
        model=server.model, messages=WEATHER, tools=TOOLS, tool_choice=tool_choice, max_tokens=80, temperature=0
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    _check_calls(final.choices[0].message.tool_calls or [], names)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
        {"extra_body": {"structured_outputs": {"regex": "[0-9"}}},
        {"extra_body": {"structured_outputs": {"grammar": "start: foo"}}},
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    ],
)
def test_bad_input_is_a_400_and_the_server_goes_on(client: openai.OpenAI, server: RunningServer, kwargs: Any) -> None:
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=server.model, messages=WEATHER, max_tokens=4, **kwargs)
    r = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=3, temperature=0)
    assert r.choices[0].message.content
