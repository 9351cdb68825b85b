"""gpt-oss's harmony format (vLLM's `openai` parser), written by hand: the `openai-harmony` package
loads its tokenizer file over the network on first use, which this server cannot rely on.

A completion is a run of messages, each `<|start|>role header<|message|>body` ended by `<|end|>`,
`<|call|>` or `<|return|>` (the first message's `<|start|>assistant` is in the prompt):

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"x":1}<|call|>

A header with `to=functions.NAME` is a call whose body is the arguments; the `final` channel is the
content; `analysis` is reasoning (the reasoning parser's business), never content.
"""

from __future__ import annotations

import json
import re

from metalserve.api.tool_parsers.base import ExtractedToolCalls, ParsedToolCall
from metalserve.api.tool_parsers.reparse import Parsed, ReparsingToolParser, hold_partial, json_text

START, MESSAGE = "<|start|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
MARKERS = (START, MESSAGE, "<|channel|>", "<|constrain|>", *ENDS)
_SPLIT_RE = re.compile("|".join(re.escape(e) for e in (*ENDS, START)))
_RECIPIENT_RE = re.compile(r"to=functions\.([^\s<]+)")
_CHANNEL_RE = re.compile(r"<\|channel\|>(\w+)")


class HarmonyToolParser(ReparsingToolParser):
    name = "openai"
    keeps_special_tokens = True  # the message structure is all special tokens

    def extract(self, text: str) -> ExtractedToolCalls:
        if not any(m in text for m in MARKERS):
            return ExtractedToolCalls(text, [])
        parsed = self.settled(text, True)  # structured: only the final channel is content, calls or not
        return ExtractedToolCalls(parsed.content.strip() or None, parsed.calls)

    def parse(self, text: str, final: bool) -> Parsed:
        if MESSAGE not in text and not any(m in text for m in MARKERS):
            return Parsed(text if final else hold_partial(text, MARKERS))  # a plain reply
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        pieces = _SPLIT_RE.split(text)
        for i, piece in enumerate(pieces):
            header, sep, body = piece.partition(MESSAGE)
            if not sep:
                continue
            closed = final or i < len(pieces) - 1
            recipient = _RECIPIENT_RE.search(header)
            if recipient is not None:
                if closed and (call := _call(recipient.group(1), body)) is not None:
                    calls.append(call)
            elif _channel(header) == "final":
                content.append(body if closed else hold_partial(body, MARKERS))
        return Parsed("".join(content), calls)


def _channel(header: str) -> str | None:
    match = _CHANNEL_RE.search(header)
    return match.group(1) if match else None


def _call(name: str, body: str) -> ParsedToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return ParsedToolCall(name, json_text(value))
