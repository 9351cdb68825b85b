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

from metalserve.api.tool_parsers.base import ParsedToolCall, Segment, ToolParser, hold_partial, json_text

START, MESSAGE = "<|start|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
MARKERS = (START, MESSAGE, "<|channel|>", "<|constrain|>", *ENDS)
_SPLIT_RE = re.compile("(" + "|".join(re.escape(e) for e in (*ENDS, START)) + ")")
_RECIPIENT_RE = re.compile(r"to=functions\.([^\s<]+)")
_HEADER_RE = re.compile("<\\|channel\\|>|<\\|message\\|>|<\\|constrain\\|>")
_CHANNEL_RE = re.compile(r"<\|channel\|>(\w+)")


class HarmonyToolParser(ToolParser):
    name = "openai"
    keeps_special_tokens = True  # the message structure is all special tokens

    def parse(self, text: str, final: bool) -> list[Segment]:
        pieces = _SPLIT_RE.split(text)  # message, separator, message, ...
        # Text before any marker is a plain reply (the first header is normally in the prompt).
        lead = _HEADER_RE.split(pieces[0], maxsplit=1)[0]
        whole = final or len(lead) < len(pieces[0]) or len(pieces) > 1
        segments = [Segment(lead if whole else hold_partial(lead, MARKERS))]
        for i in range(0, len(pieces), 2):
            piece = pieces[i]
            header, sep, body = piece.partition(MESSAGE)
            closed = final or i < len(pieces) - 1
            if not sep:
                continue
            recipient = _RECIPIENT_RE.search(header)
            if recipient is not None:
                if not closed:
                    return segments
                ending = pieces[i + 1] if i + 1 < len(pieces) else ""
                call = _call(recipient.group(1), body)
                # A call that does not parse is handed back with its markers, as the model wrote it.
                segments.append(Segment(piece + ending, [call] if call is not None else []))
            elif _channel(header) == "final":
                segments.append(Segment(body if closed else hold_partial(body, MARKERS)))
        return segments


def _channel(header: str) -> str | None:
    match = _CHANNEL_RE.search(header)
    return match.group(1) if match else None


def _call(name: str, body: str) -> ParsedToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return ParsedToolCall(name, json_text(value))
