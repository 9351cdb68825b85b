"""The Hermes / Qwen format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeatable.

Text around the calls is content; a call that is not closed, or whose body is not a call object, is
content too (as the model wrote it)."""

from __future__ import annotations

from metalserve.api.tool_parsers.base import Segment, ToolParser, parse_call_object, partial_suffix

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool) -> list[Segment]:
        segments: list[Segment] = []
        pos = 0
        while True:
            start = text.find(OPEN, pos)
            if start < 0:
                end = len(text) if final else len(text) - partial_suffix(text[pos:], OPEN)
                segments.append(Segment(text[pos:end]))
                return segments
            segments.append(Segment(text[pos:start]))
            close = text.find(CLOSE, start + len(OPEN))
            if close < 0:  # unclosed: content once the text is all there, else not settled yet
                if final:
                    segments.append(Segment(text[start:]))
                return segments
            call = parse_call_object(text[start + len(OPEN) : close])
            pos = close + len(CLOSE)
            segments.append(Segment(text[start:pos], [call] if call is not None else []))
