"""Qwen3-Coder's XML calls:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are text; they are converted by the tool's JSON schema when the request's tools are
known (`for_request`), else kept as strings unless they are JSON objects or arrays.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from metalserve.api.tool_parsers.base import ParsedToolCall
from metalserve.api.tool_parsers.reparse import Parsed, ReparsingToolParser, hold_partial, json_text

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION_RE = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_PARAM_RE = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


class Qwen3CoderToolParser(ReparsingToolParser):
    name = "qwen3_coder"

    def __init__(self, schemas: dict[str, dict[str, Any]] | None = None) -> None:
        self.schemas = schemas or {}

    def for_request(self, tools: list[Any] | None) -> Qwen3CoderToolParser:
        schemas = {}
        for tool in tools or []:
            function = (tool if isinstance(tool, dict) else tool.model_dump())["function"]
            schemas[function["name"]] = function.get("parameters") or {}
        return Qwen3CoderToolParser(schemas)

    def parse(self, text: str, final: bool) -> Parsed:
        # Some chat templates open the call with <function= directly, without <tool_call>.
        start = min((i for i in (text.find(OPEN), text.find("<function=")) if i >= 0), default=-1)
        if start < 0:
            return Parsed(text if final else hold_partial(text, (OPEN, "<function=")))
        calls = [self._call(m.group(1).strip(), m.group(2)) for m in _FUNCTION_RE.finditer(text, start)]
        return Parsed(text[:start], calls)

    def _call(self, name: str, body: str) -> ParsedToolCall:
        properties = (self.schemas.get(name) or {}).get("properties") or {}
        args = {key.strip(): _convert(value, properties.get(key.strip())) for key, value in _PARAM_RE.findall(body)}
        return ParsedToolCall(name, json_text(args))


def _convert(value: str, schema: dict[str, Any] | None) -> Any:
    """The parameter's text as the type its schema gives."""
    kind = (schema or {}).get("type")
    kinds = set(kind) if isinstance(kind, list) else {kind}
    if value.lower() == "null" and ("null" in kinds or kind is None):
        return None
    for name, fn in _CONVERTERS:
        if name in kinds:
            try:
                return fn(value)
            except ValueError:
                break
    if kind is None and value[:1] in "[{":
        try:
            return json.loads(value)
        except ValueError:
            pass
    return value


def _bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered not in ("true", "false"):
        raise ValueError(value)
    return lowered == "true"


_CONVERTERS: list[tuple[str, Callable[[str], Any]]] = [
    ("integer", int), ("number", float), ("boolean", _bool), ("object", json.loads), ("array", json.loads),
]  # fmt: skip
