"""The Hermes parser reads every form llama.cpp reads for Hermes-family models, for declared tools only."""

from __future__ import annotations

import json

import pytest

from metalserve.api.tool_parsers import get_tool_parser

Call = tuple[str, object]
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("get_weather", "read", "read_file")
]
PARIS = {"city": "Paris"}

# (model output, content left, calls as (name, arguments))
CASES = [
    ('Sure.\n```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```', "Sure.", [("get_weather", PARIS)]),
    ('```xml\n<tool_call>\n{"name": "read", "arguments": {}}\n</tool_call>\n```', None, [("read", {})]),
    ('{"name": "read_file", "arguments": {"path": "b"}}', None, [("read_file", {"path": "b"})]),
    ('<function_call>{"name": "read", "parameters": {"path": "c"}}</function_call>', None, [("read", {"path": "c"})]),
    *[
        (f'<{tag}>{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}</{tag}>', None, [("get_weather", PARIS)])
        for tag in ("tool", "tools", "response", "json", "xml", "JSON")
    ],
    ('<function=get_weather>{"city": "Paris"}</function>', None, [("get_weather", PARIS)]),
    ('Look: <function name="read">{"path": "d"}</function> done', "Look: done", [("read", {"path": "d"})]),
    # A closing cut off at the very end (EOS or max_tokens) does not undo the call.
    ('```json\n{"name": "read", "arguments": {}}\n``', None, [("read", {})]),
    ('<tool_call>{"name": "read", "arguments": {}}', None, [("read", {})]),
    # A fence after the last call, nothing after it: the call's (the grammar lets any closing follow a call).
    ('<tools>\n{"name": "read", "arguments": {}}\n</tools>\n```', None, [("read", {})]),
    ('<tool_call>{"name": "read", "arguments": {}}</tool_call>\n```\n', None, [("read", {})]),
    # Two calls in a row.
    ('{"name": "read", "arguments": {}}\n{"name": "read", "arguments": {}}', None, [("read", {}), ("read", {})]),
]
# Outputs that stay text: undeclared names, JSON that is no call, a wrong closing.
TEXTS = [
    '```json\n{"name": "rm_rf", "arguments": {}}\n```',
    '{"name": "rm_rf", "arguments": {}}',
    "<function=rm_rf>{}</function>",
    '```json\n{"city": "Paris"}\n```',
    "<function=read>not json</function>",
    '{"name": "read", "arguments": [1]}',
]


def _stream(text: str, size: int) -> tuple[str, list[tuple[str, object]]]:
    stream = get_tool_parser("hermes").for_request(TOOLS).streaming()
    content, calls = "", {}  # type: ignore[var-annotated]
    for delta in [stream.feed(text[i : i + size]) for i in range(0, len(text), size)] + [stream.finish()]:
        content += delta.content
        for d in delta.tool_calls:
            calls.setdefault(d.index, [d.name, ""])[1] += d.arguments
    return content, [(n, json.loads(a)) for n, a in (calls[i] for i in sorted(calls))]


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_loose_forms_are_calls_streamed_and_not(text: str, content: str | None, calls: list[Call]) -> None:
    got = get_tool_parser("hermes").for_request(TOOLS).extract(text)
    assert got.content == content
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == calls
    for size in (1, 3, 1000):
        assert _stream(text, size) == ((content or ""), calls)


@pytest.mark.parametrize("text", TEXTS)
def test_other_json_and_unknown_tools_stay_text(text: str) -> None:
    got = get_tool_parser("hermes").for_request(TOOLS).extract(text)
    assert got.calls == [] and got.content == text


def test_a_wrong_closing_keeps_the_call_and_leaves_the_tags_as_text() -> None:
    text = '<tool_call>{"name": "read", "arguments": {}}</tools> on'
    got = get_tool_parser("hermes").for_request(TOOLS).extract(text)
    assert [c.name for c in got.calls] == ["read"] and got.content == "<tool_call></tools> on"


def test_loose_forms_need_declared_tools() -> None:
    """Without the request's tools only the template's own <tool_call> block is a call."""
    parser = get_tool_parser("hermes")
    fenced = '```json\n{"name": "read", "arguments": {}}\n```'
    assert parser.extract(fenced).calls == []
    assert [c.name for c in parser.extract('<tool_call>{"name": "x", "arguments": {}}</tool_call>').calls] == ["x"]


def test_a_fence_is_held_back_until_it_is_known_not_to_be_a_call() -> None:
    stream = get_tool_parser("hermes").for_request(TOOLS).streaming()
    assert stream.feed("Here:\n```js").content == "Here:"
    assert stream.feed("on\n{").content == ""
    assert stream.feed('"name": "re').content == ""
    assert stream.feed('x"').content == '\n```json\n{"name": "rex"'


def test_a_fence_that_opens_a_block_after_a_call_stays_text() -> None:
    text = '<tool_call>{"name": "read", "arguments": {}}</tool_call>\n```\nprint(1)\n```'
    got = get_tool_parser("hermes").for_request(TOOLS).extract(text)
    assert [c.name for c in got.calls] == ["read"] and got.content == "```\nprint(1)\n```"
    for size in (1, 3, 1000):
        assert _stream(text, size) == ("```\nprint(1)\n```", [("read", {})])
