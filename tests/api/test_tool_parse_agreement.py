"""Streamed and non-streamed tool-call parses agree exactly, for every parser and every output.

Outputs are built from each format's fragments (complete calls, calls cut at every character, nested
markers, unknown tools, broken JSON, text before, between and after) and streamed in random pieces.
Hermes's fragments include the loose forms (fences, other tags, bare objects, `<function=...>`).
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metalserve.api.tool_parsers import TOOL_PARSERS, ToolParser, get_tool_parser

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("get_weather", "f")]

DS_CALL = '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>'
CALLS: dict[str, list[str]] = {
    "hermes": [
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"s": "\\ud800"}}</tool_call>',
        "<tool_call><tool_call>{}</tool_call>",
        "<tool_call>{not json}</tool_call>",
        # The loose forms llama.cpp reads for Hermes-family models (declared tools only).
        '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
        '```xml\n<tools>{"name": "f", "arguments": {}}</tools>\n```',
        '{"name": "f", "arguments": {"a": [1, "}"]}}',
        '<function_call>{"name": "get_weather", "parameters": {}}</function_call>',
        '<JSON>\n{"name": "f", "arguments": {}}\n</JSON>',
        '<function=get_weather>{"city": "Rome"}</function>',
        '<function name="f">{}</function>',
        '```json\n{"name": "nope", "arguments": {}}\n```',
        '{"name": "nope", "arguments": {}}',
        "<function=nope>{}</function>",
        '```json\n{"answer": 42}\n```',
        '<response>{"name": "f", "arguments": [1]}</response>',
        "```",
        "\n```\n",
        "</tool_call>",
    ],
    "llama3_json": [
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "; ",
        '<|python_tag|>{"name": "f", "parameters": {}}',
        '{"answer": 4}',
        '{"name": "nope", "parameters": {}}',
    ],
    "mistral": [
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        '[TOOL_CALLS]f[ARGS]{"a": 1}',
        "[TOOL_CALLS] not json",
        "</s>",
        "[TOOL_CALLS]nope[ARGS]{}",
    ],
    "qwen3_coder": [
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
        "<function=f>\n</function>",
        "<tool_call>\n<function=nope>\n</function>\n</tool_call>",
    ],
    "pythonic": [
        "[get_weather(city='Paris')]",
        '[f(), get_weather(city="x")]',
        "<|python_start|>[f()]<|python_end|>",
        "[nope()]",
        "[1]",
    ],
    "deepseek_v3": [
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁calls▁end｜>",
        DS_CALL,
        "<｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜>",
        "<｜end▁of▁sentence｜>",
    ],
    "openai": [
        "<|channel|>analysis<|message|>Think.<|end|>",
        "<|start|>assistant",
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>',
        "<|channel|>final<|message|>Done.<|return|>",
        "<|channel|>commentary to=functions.f<|message|>{bad<|call|>",
    ],
}
CALLS["qwen"] = CALLS["hermes"]


def calls_for(name: str) -> list[str]:
    """The fragments of a parser; a parser added later gets those of the format it derives from."""
    if name in CALLS:
        return CALLS[name]
    for base in TOOL_PARSERS[name].__mro__:
        for known, cls in TOOL_PARSERS.items():
            if cls is base and known in CALLS:
                return CALLS[known]
    raise AssertionError(f"no fragments for the tool parser {name!r}: add its format's calls to CALLS")


TEXTS = ["Hello", " ", "\n", "text before ", " text after", "a{b}c", "<", "[", "{"]


def _fragments(name: str) -> st.SearchStrategy[str]:
    whole = st.sampled_from(calls_for(name) + TEXTS)
    cut = st.sampled_from(calls_for(name)).flatmap(lambda c: st.integers(0, len(c)).map(lambda n: c[:n]))
    return st.one_of(whole, whole, cut)


def _outputs(name: str) -> st.SearchStrategy[str]:
    return st.lists(_fragments(name), max_size=5).map("".join)


def streamed(parser: ToolParser, text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]]]:
    stream = parser.streaming()
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    content, calls = "", {}  # type: ignore[var-annotated]
    deltas = [stream.feed(text[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)] + [stream.finish()]
    for delta in deltas:
        content += delta.content
        for d in delta.tool_calls:
            calls.setdefault(d.index, [d.name, ""])[1] += d.arguments
    return content, [(n, a) for n, a in (calls[i] for i in sorted(calls))]


def check_agreement(name: str, text: str, cuts: list[int]) -> None:
    parser = get_tool_parser(name).for_request(TOOLS)
    whole = parser.extract(text)
    content, calls = streamed(parser, text, cuts)
    assert (whole.content or "") == content
    assert [(c.name, c.arguments) for c in whole.calls] == calls
    for call_name, arguments in calls:
        assert call_name in ("get_weather", "f")
        assert isinstance(json.loads(arguments), dict)
        arguments.encode("utf-8")


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_streamed_and_whole_agree_on_random_outputs(name: str) -> None:
    @settings(max_examples=150, deadline=None)
    @given(text=_outputs(name), cuts=st.lists(st.integers(0, 400), max_size=8))
    def run(text: str, cuts: list[int]) -> None:
        check_agreement(name, text, cuts)

    run()


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_every_cut_of_every_call_agrees_one_character_at_a_time(name: str) -> None:
    for call in calls_for(name):
        for text in (f"A {call} B", call + call):
            for n in range(len(text) + 1):
                check_agreement(name, text[:n], list(range(n)))
