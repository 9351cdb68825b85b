"""Structured outputs and forced tool calls through HTTP over the fake core (the grammar itself is
exercised on a real model in tests/structured and tests/e2e; here: fields, errors and the mapping)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from metalserve.api.settings import ServerSettings
from metalserve.structured.params import StructuredOutputsParams
from metalserve.structured.state import GrammarState
from tests.api.conftest import MODEL, Served, live, make_served

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ARGS = '{"city": "Paris"}'
REQUIRED = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'


def say(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"say:{text}"}]


def post(server: Served, body: dict[str, Any], route: str = "chat/completions") -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{route}", json={"model": MODEL, **body}, timeout=30)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
            "response_format",
            "invalid JSON schema",
        ),
        ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs.regex", "invalid regex"),
        ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs.grammar", "invalid grammar"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "invalid JSON schema"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "whitespace_pattern", ""),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
        ({"tool_choice": "required"}, "tool_choice", "no tools"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "give only one",
        ),
    ],
)
def test_bad_specs_are_400s_naming_the_field_and_the_server_goes_on(
    server: Served, body: dict[str, Any], param: str, words: str
) -> None:
    response = post(server, {"messages": say("hi"), **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert param in (error["param"] or "") and words in error["message"]
    assert post(server, {"messages": say("still here")}).json()["choices"][0]["message"]["content"] == "still here"


def test_completions_refuse_a_bad_regex(server: Served) -> None:
    response = post(server, {"prompt": "x", "structured_outputs": {"regex": "("}}, "completions")
    assert response.status_code == 400 and response.json()["error"]["param"] == "structured_outputs.regex"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True},
                }
            },
            StructuredOutputsParams(json={"type": "object", "additionalProperties": False}),  # strict: no extra keys
        ),
        ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredOutputsParams(choice=("a", "b"))),
        (
            {
                "structured_outputs": {
                    "structural_tag": {
                        "structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}],
                        "triggers": ["<f"],
                    }
                }
            },
            StructuredOutputsParams(
                structural_tag='{"structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}], "triggers": ["<f"]}'
            ),
        ),
        ({"tools": TOOLS, "tool_choice": NAMED}, StructuredOutputsParams(json=TOOLS[0]["function"]["parameters"])),
    ],
)
def test_fields_reach_the_engine_as_one_grammar(
    server: Served, body: dict[str, Any], expected: StructuredOutputsParams
) -> None:
    assert post(server, {"messages": say("{}"), "n": 2, **body}).status_code == 200
    for request in server.core.added[-2:]:  # n = 2: each sample its own state
        assert request.sampling_params.structured_outputs == expected
        assert isinstance(request.structured, GrammarState)
    assert server.core.added[-1].structured is not server.core.added[-2].structured


def test_completions_take_structured_outputs(server: Served) -> None:
    assert post(server, {"prompt": "say:12", "structured_outputs": {"regex": "[0-9]+"}}, "completions").is_success
    assert server.core.added[-1].sampling_params.structured_outputs == StructuredOutputsParams(regex="[0-9]+")


def test_named_tool_choice_maps_the_output_to_a_call(server: Served) -> None:
    choice = post(server, {"messages": say(ARGS), "tools": TOOLS, "tool_choice": NAMED}).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_required_maps_each_array_element_to_a_call(server: Served) -> None:
    body = {"messages": say(REQUIRED), "tools": TOOLS, "tool_choice": "required"}
    choice = post(server, body).json()["choices"][0]
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]]
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert choice["finish_reason"] == "tool_calls"


@pytest.mark.parametrize(("reply", "tool_choice"), [(ARGS, NAMED), (REQUIRED, "required")])
def test_forced_calls_stream_through_the_sdk(server: Served, reply: str, tool_choice: Any) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    with client.chat.completions.stream(
        model=MODEL,
        messages=say(reply),
        tools=TOOLS,
        tool_choice=tool_choice,  # type: ignore[arg-type]
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    names = [c.function.name for c in choice.message.tool_calls or []]  # type: ignore[union-attr]
    assert names == (["get_weather"] if tool_choice == NAMED else ["get_weather", "get_time"])
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}  # type: ignore[index, union-attr]


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    with live(make_served(max_model_len=1024)) as served:  # the tiny tokenizer spells the tools out long
        yield served


@pytest.fixture(scope="module")
def no_auto() -> Iterator[Served]:
    settings = ServerSettings(tool_call_parser="hermes", log_stats_interval=0)
    with live(make_served(settings, max_model_len=1024)) as served:
        yield served


@pytest.mark.parametrize("tool_choice", ["auto", None])
def test_auto_needs_enable_auto_tool_choice(no_auto: Served, tool_choice: str | None) -> None:
    body: dict[str, Any] = {"messages": say("x"), "tools": TOOLS}
    if tool_choice:
        body["tool_choice"] = tool_choice
    response = post(no_auto, body)
    assert response.status_code == 400 and "--enable-auto-tool-choice" in response.json()["error"]["message"]


def test_forced_and_none_work_without_auto(no_auto: Served) -> None:
    assert post(no_auto, {"messages": say(ARGS), "tools": TOOLS, "tool_choice": NAMED}).is_success
    choice = post(no_auto, {"messages": say("plain"), "tools": TOOLS, "tool_choice": "none"}).json()["choices"][0]
    assert choice["message"]["content"] == "plain"
