"""Forced tool calls (`tool_choice` "required" or a named function) through the grammar.

As vLLM does, independently of --tool-call-parser: a named function constrains the output to that
tool's arguments JSON; "required" constrains it to a JSON array of {"name", "parameters"} objects,
each validated by its tool's schema. The output is then mapped back to tool calls here.
"""

from __future__ import annotations

import json
from typing import Any

from metalserve.api.tool_parsers.base import (
    CALL_ARGS_RE,
    CALL_NAME_RE,
    DeltaMessage,
    StreamingToolParser,
    ToolCallDelta,
    make_tool_call_id,
)
from metalserve.structured.params import StructuredOutputsParams
from metalserve.structured.schema import strict_schema

ANY_OBJECT: dict[str, Any] = {"type": "object"}


class ToolChoiceError(ValueError):
    """The tool_choice cannot be honoured with these tools (unknown name, no tools)."""


def _tool_fields(tool: Any) -> tuple[str, dict[str, Any]]:
    """(name, parameters schema) from a ToolDefinition model or its dict form."""
    if not isinstance(tool, dict):
        tool = tool.model_dump()
    function = tool.get("function") or {}
    schema = function.get("parameters") or ANY_OBJECT
    return function["name"], strict_schema(schema) if function.get("strict") is True else schema


def forced_name(tool_choice: Any) -> str | None:
    """The function name of a named tool_choice (model or dict), else None."""
    if tool_choice is None or isinstance(tool_choice, str):
        return None
    if not isinstance(tool_choice, dict):
        tool_choice = tool_choice.model_dump()
    return (tool_choice.get("function") or {}).get("name")


def is_forced(tool_choice: Any) -> bool:
    return tool_choice == "required" or forced_name(tool_choice) is not None


def forced_tool_params(tools: list[Any] | None, tool_choice: Any) -> StructuredOutputsParams | None:
    """The grammar of a forced tool choice; None when the choice is not forced (auto / none / absent)."""
    if not is_forced(tool_choice):
        return None
    specs = dict(_tool_fields(t) for t in tools or [])
    if not specs:
        raise ToolChoiceError("tool_choice forces a tool call but the request has no tools")
    name = forced_name(tool_choice)
    if name is not None:
        if name not in specs:
            raise ToolChoiceError(f"tool_choice names the function {name!r}, which is not in tools ({sorted(specs)})")
        return StructuredOutputsParams(json=specs[name])
    return StructuredOutputsParams(json=required_schema(specs))


def required_schema(specs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A non-empty array of calls, each {"name": one tool, "parameters": that tool's schema}.

    A tool schema with local references (`$defs`/`$ref`, as Pydantic writes them) points into its own
    root; nested here it would lose that root. Such a schema moves whole under the combined schema's
    `$defs` and its references are rewritten to point there."""
    defs: dict[str, Any] = {}
    variants = []
    for i, (name, schema) in enumerate(specs.items()):
        if _has_local_ref(schema):
            key = f"tool{i}"
            defs[key] = _rebase_refs(schema, f"#/$defs/{key}")
            schema = {"$ref": f"#/$defs/{key}"}
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    combined: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if defs:
        combined["$defs"] = defs
    return combined


def _has_local_ref(node: Any) -> bool:
    if isinstance(node, dict):
        ref = node.get("$ref")
        return (isinstance(ref, str) and ref.startswith("#")) or any(_has_local_ref(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_local_ref(v) for v in node)
    return False


def _rebase_refs(node: Any, root: str) -> Any:
    """A copy of `node` whose local references ("#", "#/$defs/X", ...) are relative to `root` instead."""
    if isinstance(node, dict):
        out = {k: _rebase_refs(v, root) for k, v in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            out["$ref"] = root + ref[1:]
        return out
    if isinstance(node, list):
        return [_rebase_refs(v, root) for v in node]
    return node


class ForcedToolStreamer(StreamingToolParser):
    """Streams a forced output as tool-call deltas.

    Named: the arguments are the output itself, sent as they grow. Required: each element of the
    array is sent as one call when its object is complete (the grammar guarantees it will be). An
    output cut by max_tokens stays a call with the arguments written so far (the finish reason says
    "length"), as OpenAI and Anthropic report a call cut short; the non-streamed answer is the same.
    """

    def __init__(self, tool_choice: Any) -> None:
        super().__init__()
        self.name = forced_name(tool_choice)
        self._text = ""
        self._pos = 0  # required: where the next array element may start
        self._id = make_tool_call_id()
        self._decoder = json.JSONDecoder()

    def feed(self, delta: str) -> DeltaMessage:
        self._text += delta
        if self.name is not None:
            return self._feed_named(delta)
        return DeltaMessage(tool_calls=self._complete_elements())

    def finish(self) -> DeltaMessage:
        if self.name is not None:
            return self._feed_named("") if self.num_calls else DeltaMessage(tool_calls=self._named_start(""))
        rest = self._text[self._pos :]
        name = CALL_NAME_RE.search(rest)
        if name is None:
            return DeltaMessage()
        args = CALL_ARGS_RE.search(rest, name.end())
        partial = rest[args.end() :].rstrip() if args else ""
        call = ToolCallDelta(self.num_calls, make_tool_call_id(), json.loads(f'"{name.group(1)}"'), partial)
        self.num_calls += 1
        return DeltaMessage(tool_calls=[call])

    def _named_start(self, arguments: str) -> list[ToolCallDelta]:
        self.num_calls = 1
        return [ToolCallDelta(0, self._id, self.name, arguments)]

    def _feed_named(self, delta: str) -> DeltaMessage:
        if not delta:
            return DeltaMessage()
        if self.num_calls == 0:
            return DeltaMessage(tool_calls=self._named_start(delta))
        return DeltaMessage(tool_calls=[ToolCallDelta(0, arguments=delta)])

    def _complete_elements(self) -> list[ToolCallDelta]:
        deltas: list[ToolCallDelta] = []
        text = self._text
        while True:
            pos = self._pos
            while pos < len(text) and text[pos] in " \t\r\n[,":
                pos += 1
            try:
                item, end = self._decoder.raw_decode(text, pos)
            except ValueError:
                return deltas  # the element is still growing
            self._pos = end
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                arguments = json.dumps(item.get("parameters", {}), ensure_ascii=False)
                deltas.append(ToolCallDelta(self.num_calls, make_tool_call_id(), item["name"], arguments))
                self.num_calls += 1
