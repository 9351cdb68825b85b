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

from metalserve.api.tool_parsers.base import ParsedToolCall, Segment, ToolParser, hold_partial, json_text

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
_FUNCTION_RE = re.compile(r"<function=([^>\n]+)>(.*)</function>", re.DOTALL)
_PARAM_RE = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"

    def __init__(self, schemas: dict[str, dict[str, Any]] | None = None) -> None:
        self.schemas = schemas or {}

    def for_request(self, tools: list[Any] | None) -> Qwen3CoderToolParser:
        parser = super().for_request(tools)
        assert isinstance(parser, Qwen3CoderToolParser)
        schemas = {}
        for tool in tools or []:
            function = (tool if isinstance(tool, dict) else tool.model_dump())["function"]
            schemas[function["name"]] = function.get("parameters") or {}
        parser.schemas = schemas
        return parser

    def parse(self, text: str, final: bool) -> list[Segment]:
        # Some chat templates open the call with <function= directly, without <tool_call>.
        segments: list[Segment] = []
        pos = 0
        while True:
            start = min((i for i in (text.find(OPEN, pos), text.find(FUNCTION, pos)) if i >= 0), default=-1)
            if start < 0:
                segments.append(Segment(text[pos:] if final else hold_partial(text[pos:], (OPEN, FUNCTION))))
                return segments
            segments.append(Segment(text[pos:start]))
            end = self._call_end(text, start, final)
            if end is None:  # not settled yet
                return segments
            if end < 0:  # never closed: the rest is content as written
                segments.append(Segment(text[start:]))
                return segments
            match = _FUNCTION_RE.search(text, start, end)
            call = self._call(match.group(1).strip(), match.group(2)) if match else None
            segments.append(Segment(text[start:end], [call] if call is not None else []))
            pos = end

    @staticmethod
    def _call_end(text: str, start: int, final: bool) -> int | None:
        """Where the call starting at `start` ends (its </tool_call> included when wrapped); -1 when it
        never closes, None when the text may still grow into the rest of it."""
        close = text.find(FUNCTION_END, start)
        if close < 0:
            return -1 if final else None
        end = close + len(FUNCTION_END)
        if not text.startswith(OPEN, start):
            return end
        after = end + len(text[end:]) - len(text[end:].lstrip())
        if text.startswith(CLOSE, after):
            return after + len(CLOSE)
        if not final and CLOSE.startswith(text[after:]):
            return None  # the closing tag may still come
        return end

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
    ("integer", int),
    ("number", float),
    ("boolean", _bool),
    ("object", json.loads),
    ("array", json.loads),
]
