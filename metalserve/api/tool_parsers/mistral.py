"""Mistral: `[TOOL_CALLS]` then a JSON array of {"name", "arguments"} (v3 tokenizers), or, from the v11
tokenizers on, `[TOOL_CALLS]name[ARGS]{...}` once per call. Text before the first marker is content."""

from __future__ import annotations

import json

from metalserve.api.tool_parsers.base import ParsedToolCall
from metalserve.api.tool_parsers.reparse import Parsed, ReparsingToolParser, hold_partial, json_text

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_DECODER = json.JSONDecoder()


class MistralToolParser(ReparsingToolParser):
    name = "mistral"
    end_markers = ("</s>",)
    keeps_special_tokens = True  # [TOOL_CALLS] is a special token

    def parse(self, text: str, final: bool) -> Parsed:
        start = text.find(TOOL_CALLS)
        if start < 0:
            return Parsed(text if final else hold_partial(text, (TOOL_CALLS,)))
        calls: list[ParsedToolCall] = []
        # A call is taken once its JSON closes (an object or array cannot grow after that).
        for piece in text[start:].split(TOOL_CALLS)[1:]:
            calls += _calls_in(piece)
        return Parsed(text[:start], calls)


def _calls_in(piece: str) -> list[ParsedToolCall]:
    piece = piece.strip()
    if ARGS in piece:  # name[ARGS]{...}
        name, _, args = piece.partition(ARGS)
        try:
            value, _ = _DECODER.raw_decode(args.strip())
        except ValueError:
            return []
        return [ParsedToolCall(name.strip(), json_text(value))]
    try:
        value, _ = _DECODER.raw_decode(piece)
    except ValueError:
        return []
    items = value if isinstance(value, list) else [value]
    return [
        ParsedToolCall(item["name"], json_text(item.get("arguments", item.get("parameters", {}))))
        for item in items
        if isinstance(item, dict) and isinstance(item.get("name"), str)
    ]
