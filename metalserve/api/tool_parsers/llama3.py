"""The Llama-3 JSON format: the reply is `{"name": ..., "parameters": {...}}` (optionally after
`<|python_tag|>`), several calls separated by `;`. Anything else is plain content."""

from __future__ import annotations

import json

from metalserve.api.tool_parsers.base import (
    CallStreamer,
    DeltaMessage,
    ExtractedToolCalls,
    ParsedToolCall,
    StreamingToolParser,
    ToolParser,
    parse_call_object,
)

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def _skip_separators(text: str, pos: int) -> int:
    while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
        pos += 1
    return pos


class Llama3JsonToolParser(ToolParser):
    """A reply that is one or more JSON call objects is a tool call; any other reply is content."""

    name = "llama3_json"

    def extract(self, text: str) -> ExtractedToolCalls:
        body = text.strip()
        body = body[len(PYTHON_TAG) :].lstrip() if body.startswith(PYTHON_TAG) else body
        if not body.startswith("{"):
            return ExtractedToolCalls(text, [])
        calls: list[ParsedToolCall] = []
        pos = 0
        while pos < len(body):
            try:
                _, end = _DECODER.raw_decode(body, pos)
            except ValueError:
                return ExtractedToolCalls(text, [])
            parsed = parse_call_object(body[pos:end])
            if parsed is None:
                return ExtractedToolCalls(text, [])
            calls.append(ParsedToolCall(*parsed))
            pos = _skip_separators(body, end)
        return ExtractedToolCalls(None, calls)

    def streaming(self) -> StreamingToolParser:
        return Llama3StreamingParser()


class Llama3StreamingParser(StreamingToolParser):
    """Decides from the first characters whether the reply is calls or content, then streams it."""

    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""
        self._mode: str | None = None  # None: undecided, "text" or "calls"
        self._pos = 0
        self._call: CallStreamer | None = None

    def feed(self, delta: str) -> DeltaMessage:
        self._buffer += delta
        out = DeltaMessage()
        if self._mode is None:
            self._decide()
        if self._mode == "text":
            out.content, self._pos = self._buffer[self._pos :], len(self._buffer)
        elif self._mode == "calls":
            self._advance(out)
        return out

    def _decide(self) -> None:
        head = self._buffer.lstrip()
        if head.startswith(PYTHON_TAG):
            self._mode, self._pos = "calls", self._buffer.index(PYTHON_TAG) + len(PYTHON_TAG)
        elif head.startswith("{"):
            self._mode, self._pos = "calls", 0
        elif head and not PYTHON_TAG.startswith(head):
            self._mode = "text"

    def _advance(self, out: DeltaMessage) -> None:
        while True:
            self._pos = _skip_separators(self._buffer, self._pos)
            if self._pos >= len(self._buffer):
                return
            if self._call is None:
                self._call = CallStreamer(self.num_calls)
            try:
                _, end = _DECODER.raw_decode(self._buffer, self._pos)
            except ValueError:
                out.tool_calls += self._call.update(self._buffer[self._pos :])
                return
            self._close_call(self._buffer[self._pos : end], out)
            self._pos = end

    def _close_call(self, text: str, out: DeltaMessage) -> None:
        assert self._call is not None
        out.tool_calls += self._call.update(text)
        rest = self._call.finish(text)
        if rest is None and self._call.name is None:
            out.content += text  # a JSON reply that is not a call
        else:
            out.tool_calls += rest or []
            self.num_calls += 1
        self._call = None

    def finish(self) -> DeltaMessage:
        out = DeltaMessage()
        if self._mode != "calls":
            out.content = self._buffer[self._pos :]
        elif self._call is not None and self._call.name is None:
            out.content = self._buffer[self._pos :]  # an unfinished object that never named a tool
        self._pos = len(self._buffer)
        return out
