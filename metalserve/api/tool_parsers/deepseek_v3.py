"""DeepSeek-V3 / R1 tool-call special tokens:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

V3.1's shorter call (`<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`) is read too.
A call that does not close or parse is content with its markers.
"""

from __future__ import annotations

import json
import re

from metalserve.api.tool_parsers.base import ParsedToolCall, Segment, ToolParser, hold_partial, json_text

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_FENCE_RE = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*```\s*$", re.DOTALL)
_STARTS = (CALLS_BEGIN, CALL_BEGIN)


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"
    end_markers = ("<｜end▁of▁sentence｜>",)
    keeps_special_tokens = True  # the markers are special tokens of DeepSeek's tokenizer

    def parse(self, text: str, final: bool) -> list[Segment]:
        segments: list[Segment] = []
        pos = 0
        opener = ""  # a calls-begin marker, kept with whatever follows it (a call, or content if not one)
        while pos < len(text):
            if text.startswith(CALLS_BEGIN, pos) or text.startswith(CALLS_END, pos):
                marker = CALLS_BEGIN if text.startswith(CALLS_BEGIN, pos) else CALLS_END
                opener += marker
                pos += len(marker)
                continue
            if text.startswith(CALL_BEGIN, pos):
                end = text.find(CALL_END, pos)
                if end < 0:
                    if final:
                        segments.append(Segment(opener + text[pos:]))
                    return segments
                end += len(CALL_END)
                call = _call(text[pos + len(CALL_BEGIN) : end - len(CALL_END)])
                segments.append(Segment(opener + text[pos:end], [call] if call is not None else []))
                opener, pos = "", end
                continue
            nxt = min((i for m in (*_STARTS, CALLS_END) if (i := text.find(m, pos)) >= 0), default=-1)
            if nxt < 0:
                piece = text[pos:] if final else hold_partial(text[pos:], (*_STARTS, CALLS_END))
                if piece:
                    segments.append(Segment(opener + piece))
                return segments
            segments.append(Segment(opener + text[pos:nxt]))
            opener, pos = "", nxt
        if final and opener and not any(s.calls for s in segments):
            segments.append(Segment(opener))  # markers with no call at all: the text as written
        return segments


def _call(body: str) -> ParsedToolCall | None:
    head, sep, args = body.partition(SEP)
    if not sep:
        return None
    if head.strip() == "function":  # V3: function<sep>name\n```json ... ```
        name, _, args = args.partition("\n")
    else:  # V3.1: name<sep>{...}
        name = head
    fenced = _FENCE_RE.match(args)
    raw = fenced.group(1) if fenced else args.strip()
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return ParsedToolCall(name.strip(), json_text(value))
