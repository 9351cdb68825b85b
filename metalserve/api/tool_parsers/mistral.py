"""Mistral: `[TOOL_CALLS]` then a JSON array of {"name", "arguments"} (v3 tokenizers), or, from the v11
tokenizers on, `[TOOL_CALLS]name[ARGS]{...}` once per call. Text before the first marker is content;
a marker whose calls do not parse is content with its text."""

from __future__ import annotations

import json

from metalserve.api.tool_parsers.base import ParsedToolCall, Segment, ToolParser, hold_partial, json_text

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_DECODER = json.JSONDecoder()


class MistralToolParser(ToolParser):
    name = "mistral"
    end_markers = ("</s>",)
    keeps_special_tokens = True  # [TOOL_CALLS] is a special token

    def parse(self, text: str, final: bool) -> list[Segment]:
        start = text.find(TOOL_CALLS)
        if start < 0:
            return [Segment(text if final else hold_partial(text, (TOOL_CALLS,)))]
        segments = [Segment(text[:start])]
        pieces = text[start:].split(TOOL_CALLS)[1:]
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            segments += _piece_segments(piece, closed=final or not last)
        return segments


def _piece_segments(piece: str, closed: bool) -> list[Segment]:
    """What follows one marker: its calls once their JSON closes (then any text after it is content)."""
    marked = TOOL_CALLS + piece
    name, has_args, _ = piece.partition(ARGS)
    start = len(name) + len(ARGS) if has_args else 0
    while start < len(piece) and piece[start].isspace():
        start += 1
    try:
        value, end = _DECODER.raw_decode(piece, start)
    except ValueError:
        return [Segment(marked)] if closed else []
    calls = [ParsedToolCall(name.strip(), json_text(value))] if has_args else _array_calls(value)
    segments = [Segment(TOOL_CALLS + piece[:end], calls)]
    tail = piece[end:]
    if tail:
        segments.append(Segment(tail if closed else hold_partial(tail, (TOOL_CALLS,))))
    return segments


def _array_calls(value: object) -> list[ParsedToolCall]:
    """The calls of a v3 array (or one object); [] when any item is not a call (all is content then)."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return []
        calls.append(ParsedToolCall(item["name"], json_text(item.get("arguments", item.get("parameters", {})))))
    return calls
