"""The pythonic format (Llama 3.2 / 4 and others): the reply is a Python list of calls,
`[get_weather(city="Paris"), get_time()]`, optionally inside <|python_start|> ... <|python_end|>.
Arguments must be literals. A reply that is not such a list is content."""

from __future__ import annotations

import ast
from typing import Any

from metalserve.api.tool_parsers.base import ParsedToolCall, Segment, ToolParser, json_text

START, END = "<|python_start|>", "<|python_end|>"


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def parse(self, text: str, final: bool) -> list[Segment]:
        body = text.strip().removeprefix(START).removesuffix(END).strip()
        could_be_calls = body.startswith("[") or START.startswith(text.strip()) or not body
        if not could_be_calls:
            return [Segment(text)]
        if not final:  # a list may still be followed by text that makes it all content: wait for the end
            return []
        return [Segment(text, _calls(body) or [])]


def _calls(body: str) -> list[ParsedToolCall] | None:
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            args: dict[str, Any] = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg}
        except ValueError:
            return None
        calls.append(ParsedToolCall(node.func.id, json_text(args)))
    return calls


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id in ("true", "false", "null"):  # JSON spellings
        return {"true": True, "false": False, "null": None}[node.id]
    return ast.literal_eval(node)
