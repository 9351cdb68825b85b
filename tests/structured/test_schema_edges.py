"""JSON schemas as real clients send them: Pydantic's `$defs`/`$ref` under a forced "any tool" choice,
and `format` values the grammar cannot enforce (annotations, as vLLM and OpenAI take them)."""

from __future__ import annotations

import pytest

from metalserve.api.tool_choice import forced_tool_params
from metalserve.structured.compiler import GrammarCompiler
from metalserve.structured.params import StructuredOutputsParams as S
from metalserve.structured.schema import drop_annotation_formats, strict_schema
from tests.api.fakes import tiny_tokenizer

TOK = tiny_tokenizer()
COMPILER = GrammarCompiler(TOK)

# What Pydantic writes for `class Trip(BaseModel): start: Loc; stops: list[Loc]` (and a recursive one).
TRIP = {
    "$defs": {
        "Loc": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        }
    },
    "type": "object",
    "properties": {"start": {"$ref": "#/$defs/Loc"}, "stops": {"type": "array", "items": {"$ref": "#/$defs/Loc"}}},
    "required": ["start", "stops"],
    "additionalProperties": False,
}
TREE = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 1}},
    "required": ["name", "kids"],
    "additionalProperties": False,
}


def tools(*schemas: dict[str, object]) -> list[dict[str, object]]:
    names = ["plan_trip", "tree", "now"]
    return [
        {"type": "function", "function": {"name": n, "parameters": s}} for n, s in zip(names, schemas, strict=False)
    ]


def matches(spec: S, text: str) -> bool:
    """Whether the grammar compiles, takes `text` whole and may end after it."""
    state = COMPILER.make_state(spec)
    COMPILER.submit(spec).result()
    assert state.is_ready() and state.error is None and state.matcher is not None
    for token in TOK.encode(text, add_special_tokens=False):
        if state.terminated or (state.accept(token) and state.error is not None):
            return False  # ended before the text did, or refused a token
    return state.matcher.is_accepting()


def test_any_tool_keeps_each_schemas_own_definitions() -> None:
    spec = forced_tool_params(tools(TRIP, TREE, {"type": "object"}), "required")
    assert spec is not None
    trip = '[{"name": "plan_trip", "parameters": {"start": {"city": "Oslo"}, "stops": [{"city": "Rome"}]}}]'
    assert matches(spec, trip)  # before the fix: "Pointer '/$defs/Loc' does not exist"
    assert matches(spec, '[{"name": "tree", "parameters": {"name": "a", "kids": [{"name": "b", "kids": []}]}}]')
    assert not matches(spec, '[{"name": "plan_trip", "parameters": {"start": {"town": "Oslo"}, "stops": []}}]')
    assert not matches(spec, '[{"name": "tree", "parameters": {"name": "a", "kids": [{"kids": []}]}}]')


def test_a_named_tool_with_definitions_is_its_own_root() -> None:
    spec = forced_tool_params(tools(TRIP), {"type": "function", "function": {"name": "plan_trip"}})
    assert spec is not None and matches(spec, '{"start": {"city": "Oslo"}, "stops": []}')


@pytest.mark.parametrize(
    "fmt", ["password", "binary", "file-path", "int32", "float", "base64", "regex", "json-pointer", "x-made-up"]
)
def test_a_format_the_grammar_cannot_enforce_is_an_annotation(fmt: str) -> None:
    schema = {"type": "object", "properties": {"v": {"type": "string", "format": fmt}}, "required": ["v"]}
    assert matches(S(json=schema), '{"v": "any text"}')  # before the fix: a compile error (a 400)


def test_a_format_the_grammar_enforces_still_constrains() -> None:
    schema = {"type": "object", "properties": {"d": {"type": "string", "format": "date"}}, "required": ["d"]}
    assert matches(S(json=schema), '{"d": "2026-12-02"}')
    assert not matches(S(json=schema), '{"d": "tomorrow"}')


def test_only_format_keywords_are_dropped_not_data_or_property_names() -> None:
    schema = {
        "type": "object",
        "properties": {"format": {"type": "string", "format": "int32"}, "when": {"type": "string", "format": "date"}},
        "const": {"format": "password"},
    }
    assert drop_annotation_formats(schema) == {
        "type": "object",
        "properties": {"format": {"type": "string"}, "when": {"type": "string", "format": "date"}},
        "const": {"format": "password"},
    }


@pytest.mark.parametrize("n", [2000, 5000])
def test_a_long_choice_list_is_one_grammar_that_takes_exactly_its_entries(n: int) -> None:
    spec = S(choice=tuple(f"c{i}" for i in range(n)))  # before: 2,000 entries were refused by the engine
    assert matches(spec, f"c{n - 1}") and matches(spec, "c1") and matches(spec, "c1000")
    assert not matches(spec, f"c{n}") and not matches(spec, "c1x")


def test_strict_takes_no_keys_beyond_the_properties_at_any_depth() -> None:
    inner = {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}
    schema = {"type": "object", "properties": {"a": inner}, "required": ["a"]}
    extra = '{"a": {"b": 1, "c": 2}}'
    assert matches(S(json=schema), extra)  # JSON Schema's default: more keys allowed
    assert not matches(S(json=strict_schema(schema)), extra)
    assert matches(S(json=strict_schema(schema)), '{"a": {"b": 1}}')
    loose = {**schema, "additionalProperties": True}
    assert strict_schema(loose)["additionalProperties"] is True  # what the schema says stays
