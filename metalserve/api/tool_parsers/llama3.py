"""The Llama-3 JSON format: the reply is `{"name": ..., "parameters": {...}}` (optionally after
`<|python_tag|>`), several calls separated by `;`. A reply that does not start so is plain content;
an object that is not a call, an unfinished one, or text after the calls is content too."""

from __future__ import annotations

import json

from metalserve.api.tool_parsers.base import Segment, ToolParser, parse_call_object

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def _skip_separators(text: str, pos: int) -> int:
    while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
        pos += 1
    return pos


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, final: bool) -> list[Segment]:
        head = text.lstrip()
        lead = len(text) - len(head)
        if head.startswith(PYTHON_TAG):
            pos = lead + len(PYTHON_TAG)
        elif head.startswith("{"):
            pos = lead
        elif not final and PYTHON_TAG.startswith(head):  # nothing decided yet (empty, or a partial tag)
            return []
        else:
            return [Segment(text)]
        segments: list[Segment] = []
        while True:
            pos = _skip_separators(text, pos)
            if pos >= len(text):
                return segments
            if text[pos] != "{":  # text after the calls
                segments.append(Segment(text[pos:]))
                return segments
            try:
                _, end = _DECODER.raw_decode(text, pos)
            except ValueError:
                if final:
                    segments.append(Segment(text[pos:]))
                return segments
            call = parse_call_object(text[pos:end])
            segments.append(Segment(text[pos:end], [call] if call is not None else []))
            pos = end
