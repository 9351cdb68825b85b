"""DeepSeek-V3 / R1 tool-call special tokens:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

V3.1's shorter call (`<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`) is read too.
"""

from __future__ import annotations

import json
import re

from metalserve.api.tool_parsers.base import ParsedToolCall
from metalserve.api.tool_parsers.reparse import Parsed, ReparsingToolParser, hold_partial, json_text

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_CALL_RE = re.compile(re.escape(CALL_BEGIN) + r"(.*?)" + re.escape(CALL_END), re.DOTALL)
_FENCE_RE = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*```\s*$", re.DOTALL)


class DeepSeekV3ToolParser(ReparsingToolParser):
    name = "deepseek_v3"
    end_markers = ("<｜end▁of▁sentence｜>",)
    keeps_special_tokens = True  # the markers are special tokens of DeepSeek's tokenizer

    def parse(self, text: str, final: bool) -> Parsed:
        start = text.find(CALLS_BEGIN)
        if start < 0:
            start = text.find(CALL_BEGIN)
        if start < 0:
            return Parsed(text if final else hold_partial(text, (CALLS_BEGIN, CALL_BEGIN)))
        calls = [call for m in _CALL_RE.finditer(text, start) if (call := _call(m.group(1))) is not None]
        return Parsed(text[:start], calls)


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
