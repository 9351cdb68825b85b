"""The lazy tool-call grammar: text is free until a declared tool's call opens, then the call is valid for
its schema to the end; every form the grammar lets through is a call the Hermes parser reads."""

from __future__ import annotations

import json
from typing import Any

import llguidance
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from metalserve.api.tool_parsers import get_tool_parser
from metalserve.api.tool_parsers.argument_grammar import MAX_ANY_ORDER
from metalserve.api.tool_parsers.hermes_grammar import hermes_call_grammar
from metalserve.structured.compiler import GrammarCompiler
from metalserve.structured.params import StructuredOutputsParams
from tests.api.fakes import tiny_tokenizer

TOK = tiny_tokenizer()
ADDED = frozenset(TOK.get_added_vocab())  # <tool_call> and </tool_call> are added tokens here, as in Qwen's
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "f", "parameters": {}}},
]
COMPILER = GrammarCompiler(TOK)


def matcher(parallel: bool = True) -> llguidance.LLMatcher:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}  # type: ignore[index]
    text = hermes_call_grammar(schemas, parallel=parallel, special_tokens=ADDED)
    return COMPILER.compile(StructuredOutputsParams(grammar=text)).matcher.deep_copy()


def feed(m: llguidance.LLMatcher, text: str) -> bool:
    """Whether the grammar takes every token of `text`."""
    return all(m.consume_token(t) for t in TOK.encode(text, add_special_tokens=False))


ARGS = '{"city": "Paris", "days": 2}'
ANY = '{"anything": [1, {"x": null}]}'
CALLS = [  # (the call as a model writes it, its tool, its arguments)
    (f'{{"name": "get_weather", "arguments": {ARGS}}}', "get_weather", ARGS),
    (f'```json\n{{"name": "get_weather", "arguments": {ARGS}}}\n```', "get_weather", ARGS),
    (f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>', "get_weather", ARGS),
    (f'<tools>{{"name": "get_weather", "arguments": {ARGS}}}</tools>', "get_weather", ARGS),
    (f'```xml\n<function_call>{{"name": "f", "arguments": {ANY}}}\n</function_call>\n```', "f", ANY),
    (f"<function=get_weather>{ARGS}</function>", "get_weather", ARGS),
    (f'<function name="f">{ANY}</function>', "f", ANY),
    (f'<tool_call>{{"name": "f", "arguments": {ANY}}}</tool_call>', "f", ANY),
]


@pytest.mark.parametrize(("call", "name", "arguments"), CALLS)
def test_every_form_is_taken_whole_and_read_back_as_the_same_call(call: str, name: str, arguments: str) -> None:
    m = matcher(parallel=False)
    text = "Let me look that up. " + call
    assert feed(m, text) and not m.is_error()
    assert m.is_accepting()
    parsed = get_tool_parser("hermes").for_request(TOOLS).extract(text)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [(name, json.loads(arguments))]


@pytest.mark.parametrize(
    ("opening", "bad"),
    [
        ('```json\n{"name": "get_weather"', ', "arguments": {"city": 5}}'),  # wrong type
        ('{"name": "get_weather"', ', "arguments": {"days": 2}}'),  # a required key missing
        ('<tool_call>{"name": "get_weather"', ', "arguments": {"city": "x", "days": 0}}'),  # below the minimum
        ('<tool_call>{"name": "get_weather"', ', "arguments": {"city": "x", "wind": 1}}'),  # an unknown key
        ("<function=get_weather>", '{"city": "Paris"'),  # then prose instead of the rest
    ],
)
def test_once_a_call_opens_its_arguments_must_follow_the_schema(opening: str, bad: str) -> None:
    m = matcher()
    assert feed(m, "Sure. " + opening)
    assert not feed(m, bad + " and more prose") or not m.is_accepting()


def test_the_tool_call_token_admits_only_declared_tools() -> None:
    m = matcher()
    assert not feed(m, '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>')


def test_a_call_tag_then_a_name_holds_the_name_to_the_declared_tools() -> None:
    """`<tools>{"name": "` is a call whatever name the model had in mind (the 1.5B coder wrote
    `<tools>{"name": "read_stdin"` for Codex's exec_command): the name must be a declared one."""
    for tag in ("tools", "function_call", "response"):
        m = matcher()
        assert feed(m, f'Let me check.\n<{tag}>\n{{"name": "')
        assert not feed(m.deep_copy(), 'read_stdin", "arguments": {}}')
        assert feed(m, f'get_weather", "arguments": {ARGS}}}\n</{tag}>') and m.is_accepting()


def test_calls_of_other_tools_and_json_about_other_things_stay_free_text() -> None:
    m = matcher()
    text = 'Example: ```json\n{"name": "rm_rf", "arguments": {}}\n``` and {"city": 5} <tools>[]</tools>'
    assert feed(m, text) and m.is_accepting()


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.sampled_from(list('ab {}"<>`:,\n_/namefunctiolsjx=')), max_size=60))
def test_any_text_without_a_call_is_free(text: str) -> None:
    # The alphabet spells `<tool_call>`, an added token here as in Qwen's vocabulary: a call's opening.
    assume("<tool_call>" not in text and "</tool_call>" not in text)
    m = matcher()
    assert feed(m, text) and m.is_accepting()


def test_parallel_calls_follow_one_another_and_nothing_else_follows_a_single_call() -> None:
    call = f'<tool_call>{{"name": "get_weather", "arguments": {ARGS}}}</tool_call>'
    many = matcher(parallel=True)
    assert feed(many, call + "\n" + call) and many.is_accepting()
    one = matcher(parallel=False)
    assert feed(one, call) and not feed(one, "\nThat was the call.")


def test_schemas_are_leniently_compiled_and_made_objects() -> None:
    lenient: dict[str, Any] = {"properties": {"url": {"type": "string", "format": "made-up-format"}}}
    text = hermes_call_grammar({"fetch": lenient})
    compiled = COMPILER.compile(StructuredOutputsParams(grammar=text))
    m = compiled.matcher.deep_copy()
    assert feed(m, '{"name": "fetch", "arguments": {"url": "x"}}')
    with pytest.raises(ValueError, match="at least one tool"):
        hermes_call_grammar({})


def test_a_name_the_model_would_go_on_past_is_held_to_the_tools() -> None:
    m = matcher()
    assert feed(m, 'Sure: {"name": "get_weather')
    assert not feed(m, '.py", "arguments": {}}')  # the opening ends at the name: the quote comes next
    names = {"read": {}, "read_file": {}}  # one name the start of another: both stay reachable
    for name in names:
        m = COMPILER.compile(StructuredOutputsParams(grammar=hermes_call_grammar(names))).matcher.deep_copy()
        assert feed(m, f'{{"name": "{name}", "arguments": {{}}}}') and m.is_accepting()


def test_arguments_may_be_pretty_printed_but_whitespace_is_bounded() -> None:
    m = matcher()
    assert feed(m, '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```')
    assert m.is_accepting()
    m = matcher()
    assert not feed(m, '{"name": "get_weather", "arguments": {"city":' + "\n" * 40)


@pytest.mark.parametrize(
    ("arguments", "valid"),
    [
        ('{"days": 2, "city": "Paris"}', True),  # the model's order, not the schema's
        ('{"city": "Paris", "days": 2}', True),
        ('{"days": 2}', False),  # the required city never written
        ('{"city": "Paris", "city": "Rome"}', False),  # a property twice
        ('{"days": 0, "city": "Paris"}', False),  # each value still held to its property's schema
    ],
)
def test_the_arguments_properties_come_in_any_order_each_once_with_the_required_ones(
    arguments: str, valid: bool
) -> None:
    """llguidance's JSON grammar fixes properties to the schema's order; a model writing its own (the
    1.5B coder put Bash's `timeout` after `description`) was steered to another property instead."""
    m = matcher()
    took = feed(m, f'<tool_call>{{"name": "get_weather", "arguments": {arguments}}}</tool_call>')
    assert (took and m.is_accepting()) == valid


def test_a_schema_the_any_order_rules_cannot_express_keeps_the_schemas_order() -> None:
    many = {f"p{k}": {"type": "integer"} for k in range(MAX_ANY_ORDER + 1)}
    shapes = [
        {"type": "object", "properties": many},  # too many properties for a rule per subset
        {"type": "object", "properties": {"a": {"$ref": "#/$defs/n"}, "b": {}}, "$defs": {"n": {"type": "integer"}}},
    ]
    for schema in shapes:
        text = hermes_call_grammar({"g": schema})
        assert "args_0_after_" not in text
        m = COMPILER.compile(StructuredOutputsParams(grammar=text)).matcher.deep_copy()
        names = list(schema["properties"])
        forward = ", ".join(f'"{n}": 1' for n in names)
        backward = ", ".join(f'"{n}": 1' for n in reversed(names))
        assert feed(m.deep_copy(), f'{{"name": "g", "arguments": {{{forward}}}}}')
        assert not feed(m, f'{{"name": "g", "arguments": {{{backward}}}}}')


def test_a_property_name_is_matched_as_the_model_writes_it_unescaped() -> None:
    text = hermes_call_grammar({"g": {"type": "object", "properties": {"größe": {"type": "integer"}, "x": {}}}})
    assert "args_0_after_" in text  # the any-order rules, not llguidance's grammar
    m = COMPILER.compile(StructuredOutputsParams(grammar=text)).matcher.deep_copy()
    assert feed(m, '{"name": "g", "arguments": {"x": 2, "größe": 1}}') and m.is_accepting()
