"""Tool-call parsers over whole texts and over streams split at every possible size."""

from __future__ import annotations

import json

import pytest

from metalserve.api.tool_parsers import StreamingToolParser, ToolParser, get_tool_parser

HERMES_ONE = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
HERMES_TWO = (
    '<tool_call>{"name": "a", "arguments": {"x": {"y": [1, 2]}, "s": "}"}}</tool_call>\n'
    '<tool_call>{"arguments": {"z": "caf\u00e9"}, "name": "b"}</tool_call>'
)
LLAMA_ONE = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}'
LLAMA_TWO = '<|python_tag|>{"name": "a", "parameters": {"q": 1}}; {"name": "b", "parameters": {}}'


def _stream(parser: ToolParser, text: str, size: int) -> tuple[str, list[dict[str, str]], list[list[str]]]:
    """Feed `text` in pieces; merge deltas as the OpenAI SDK does. Also return the keys of each delta."""
    stream: StreamingToolParser = parser.streaming()
    content, calls, shapes = "", {}, []  # type: ignore[var-annotated]
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    for delta in [stream.feed(p) for p in pieces] + [stream.finish()]:
        content += delta.content
        for d in delta.tool_calls:
            if d.index not in calls:
                assert d.id and d.name, "the first delta of an index carries id and name"
                calls[d.index] = {"id": d.id, "name": d.name, "arguments": ""}
                shapes.append(["id", "name"])
            else:
                assert d.id is None and d.name is None
            calls[d.index]["arguments"] += d.arguments
    return content, [calls[i] for i in sorted(calls)], shapes


def _names_args(calls: list[dict[str, str]]) -> list[tuple[str, object]]:
    return [(c["name"], json.loads(c["arguments"])) for c in calls]


def test_hermes_whole_text() -> None:
    got = get_tool_parser("hermes").extract(HERMES_ONE)
    assert got.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [("get_weather", {"city": "Paris"})]
    assert got.calls[0].id.startswith("call_")


def test_hermes_two_calls_and_key_order() -> None:
    got = get_tool_parser("hermes").extract(HERMES_TWO)
    assert got.content is None
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [
        ("a", {"x": {"y": [1, 2]}, "s": "}"}),
        ("b", {"z": "caf\u00e9"}),
    ]


def test_hermes_plain_and_broken_text_stay_content() -> None:
    parser = get_tool_parser("hermes")
    assert parser.extract("just text").calls == []
    broken = "<tool_call>{not json}</tool_call>"
    assert parser.extract(broken).content == broken and parser.extract(broken).calls == []


@pytest.mark.parametrize("size", [1, 2, 3, 5, 11, 1000])
def test_hermes_streamed_equals_whole(size: int) -> None:
    parser = get_tool_parser("hermes")
    for text in (HERMES_ONE, HERMES_TWO):
        content, calls, _ = _stream(parser, text, size)
        whole = parser.extract(text)
        assert (content.strip() or None) == whole.content
        assert _names_args(calls) == [(c.name, json.loads(c.arguments)) for c in whole.calls]


def test_hermes_sends_a_call_whole_once_it_closes() -> None:
    stream = get_tool_parser("hermes").streaming()
    assert stream.feed('<tool_call>{"name": "f", "arguments": {"city": "Par').tool_calls == []
    assert stream.feed('is"}}').tool_calls == []
    (call,) = stream.feed("</tool_call>").tool_calls
    assert (call.name, json.loads(call.arguments)) == ("f", {"city": "Paris"})


ISSUE_UNTERMINATED = '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa'
ISSUE_AROUND = 'text before <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call> text after'


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_hermes_unclosed_call_is_content_streamed_and_not(size: int) -> None:
    parser = get_tool_parser("hermes")
    content, calls, _ = _stream(parser, ISSUE_UNTERMINATED, size)
    assert content == ISSUE_UNTERMINATED and calls == []
    whole = parser.extract(ISSUE_UNTERMINATED)
    assert whole.content == ISSUE_UNTERMINATED and whole.calls == []


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_hermes_keeps_text_before_and_after_a_call(size: int) -> None:
    parser = get_tool_parser("hermes")
    whole = parser.extract(ISSUE_AROUND)
    assert whole.content == "text before text after"
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [("get_weather", {"city": "Paris"})]
    content, calls, _ = _stream(parser, ISSUE_AROUND, size)
    assert content == whole.content and _names_args(calls) == [("get_weather", {"city": "Paris"})]


def test_unknown_tools_and_unencodable_arguments_stay_content() -> None:
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    parser = get_tool_parser("hermes").for_request(tools)
    unknown = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert parser.extract(unknown).calls == [] and parser.extract(unknown).content == unknown
    surrogate = '<tool_call>{"name": "get_weather", "arguments": {"city": "\\ud800"}}</tool_call>'
    assert parser.extract(surrogate).calls == [] and parser.extract(surrogate).content == surrogate
    not_object = '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>'
    assert parser.extract(not_object).calls == []


def test_hermes_partial_tag_is_not_leaked_as_content() -> None:
    stream = get_tool_parser("hermes").streaming()
    assert stream.feed("Hi <tool_").content == "Hi"  # the space waits: it is layout if a call follows
    assert stream.feed("x").content == " <tool_x"  # it was not a tag after all


def test_llama3_whole_text() -> None:
    parser = get_tool_parser("llama3_json")
    got = parser.extract(LLAMA_ONE)
    assert got.content is None
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [("get_weather", {"city": "Paris", "unit": "c"})]
    two = parser.extract(LLAMA_TWO)
    assert [(c.name, json.loads(c.arguments)) for c in two.calls] == [("a", {"q": 1}), ("b", {})]


def test_llama3_non_call_text_is_content() -> None:
    parser = get_tool_parser("llama3_json")
    for text in ("The answer is 4.", '{"answer": 4}', '{"name": "x", "parameters": {'):
        got = parser.extract(text)
        assert got.calls == [] and got.content == text


@pytest.mark.parametrize("size", [1, 2, 4, 9, 1000])
def test_llama3_streamed_equals_whole(size: int) -> None:
    parser = get_tool_parser("llama3_json")
    for text in (LLAMA_ONE, LLAMA_TWO):
        content, calls, _ = _stream(parser, text, size)
        assert content.strip() == ""
        assert _names_args(calls) == [(c.name, json.loads(c.arguments)) for c in parser.extract(text).calls]
    content, calls, _ = _stream(parser, "Plain answer.", size)
    assert content == "Plain answer." and calls == []
    content, calls, _ = _stream(parser, '{"answer": 4}', size)
    assert content == '{"answer": 4}' and calls == []


def test_unknown_parser_name() -> None:
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")
