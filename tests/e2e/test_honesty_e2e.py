"""Issue 28 on the real server and the default model: constrained answers that never claim "stop" when
they were cut or broke their grammar, grammars that cannot work refused up front, and tool calls forced
through `structured_outputs.choice` next to `tools` parsed the same streamed and not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from tests.e2e.server import RunningServer, running_server

pytestmark = pytest.mark.slow
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CYCLIC = {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}
ASK = [{"role": "user", "content": "Describe a city as JSON."}]


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


def chat(server: RunningServer, stream: bool, **body: Any) -> tuple[str, list[Any], str | None, int]:
    """(content, tool calls, finish_reason, status) of one chat request, streamed or not."""
    payload = {"model": server.model, "messages": ASK, "temperature": 0, **body}
    url = f"{server.v1}/chat/completions"
    if not stream:
        response = httpx.post(url, json=payload, timeout=300)
        if response.status_code != 200:
            return response.text, [], None, response.status_code
        choice = response.json()["choices"][0]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"].get("tool_calls") or []]
        return choice["message"]["content"] or "", calls, choice["finish_reason"], 200
    content, calls, reason = "", {}, None  # type: ignore[var-annotated]
    with httpx.stream("POST", url, json={**payload, "stream": True}, timeout=300) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            content += choice["delta"].get("content") or ""
            for d in choice["delta"].get("tool_calls") or []:
                entry = calls.setdefault(d["index"], ["", ""])
                entry[0] = d["function"].get("name") or entry[0]
                entry[1] += d["function"].get("arguments") or ""
            reason = choice["finish_reason"] or reason
    return content, [tuple(calls[i]) for i in sorted(calls)], reason, 200


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_longer_than_max_tokens_ends_with_length(server: RunningServer, stream: bool) -> None:
    content, _, reason, status = chat(server, stream, max_tokens=8, structured_outputs={"regex": "a{1000}"})
    assert status == 200 and reason == "length"
    assert content and set(content) == {"a"}


@pytest.mark.parametrize(
    "spec",
    [
        {"regex": "a{1000000}"},
        {"regex": "((a{100}){100}){100}"},
        {"json": CYCLIC},
        {"grammar": 'start: a\na: a "x"'},
        {"choice": [f"option{i}" for i in range(100_000)]},
    ],
    ids=["a{1000000}", "nested-repeat", "cyclic-ref", "empty-lark", "choice-100k"],
)
def test_the_issue_grammars_are_400s(server: RunningServer, spec: dict[str, Any]) -> None:
    text, _, _, status = chat(server, False, max_tokens=16, structured_outputs=spec)
    assert status == 400
    message = json.loads(text)["error"]["message"]
    assert "panic" not in message and "backtrace" not in message and "\n" not in message


SCHEMAS = [
    {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
        "required": ["city", "n"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4},
    {
        "type": "object",
        "required": ["ok"],
        "properties": {"ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
    },
]


@pytest.mark.parametrize("max_tokens", [4, 40])
@pytest.mark.parametrize("schema", SCHEMAS)
def test_a_json_schema_answer_that_says_stop_parses_and_validates(
    server: RunningServer, schema: dict[str, Any], max_tokens: int
) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    for stream in (False, True):
        content, _, reason, status = chat(server, stream, max_tokens=max_tokens, response_format=fmt)
        assert status == 200 and reason in ("stop", "length")
        if reason == "stop":
            jsonschema.validate(json.loads(content), schema)


UNCLOSED = '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa'
AROUND = 'text before <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call> text after'
UNKNOWN = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'


@pytest.mark.parametrize(
    ("forced", "content", "calls", "reason"),
    [
        (UNCLOSED, UNCLOSED, [], "stop"),
        (AROUND, "text before text after", [("get_weather", '{"city": "Paris"}')], "tool_calls"),
        (UNKNOWN, UNKNOWN, [], "stop"),
    ],
    ids=["unclosed", "text-around", "unknown-tool"],
)
def test_forced_hermes_outputs_parse_the_same_streamed_and_not(
    server: RunningServer, forced: str, content: str, calls: list[Any], reason: str
) -> None:
    body = {"tools": TOOLS, "max_tokens": 200, "structured_outputs": {"choice": [forced]}}
    whole = chat(server, False, **body)
    assert whole == chat(server, True, **body)
    assert whole == (content, calls, reason, 200)


def test_a_forced_anthropic_call_cut_by_max_tokens(server: RunningServer) -> None:
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", timeout=300)
    message = client.messages.create(
        model=server.model,
        max_tokens=5,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[
            {
                "name": "get_weather",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            }
        ],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    assert message.stop_reason == "max_tokens"
    assert [b.type for b in message.content] == ["tool_use"] and isinstance(message.content[0].input, dict)  # type: ignore[union-attr]
