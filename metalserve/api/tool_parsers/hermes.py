"""The Hermes / Qwen format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeatable."""

from __future__ import annotations

import re

from metalserve.api.tool_parsers.base import (
    CallStreamer,
    DeltaMessage,
    ExtractedToolCalls,
    ParsedToolCall,
    StreamingToolParser,
    ToolParser,
    parse_call_object,
    partial_suffix,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL_RE = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


class HermesToolParser(ToolParser):
    """Calls wrapped in <tool_call> tags; text before the first call is the message content."""

    name = "hermes"

    def extract(self, text: str) -> ExtractedToolCalls:
        if OPEN not in text:
            return ExtractedToolCalls(text, [])
        calls: list[ParsedToolCall] = []
        for match in _CALL_RE.finditer(text):
            parsed = parse_call_object(match.group(1))
            if parsed is None:
                return ExtractedToolCalls(text, [])  # not well-formed: give the text back untouched
            calls.append(ParsedToolCall(*parsed))
        content = text[: text.index(OPEN)].strip()
        return ExtractedToolCalls(content or None, calls)

    def streaming(self) -> StreamingToolParser:
        return HermesStreamingParser()


class HermesStreamingParser(StreamingToolParser):
    """Content until `<tool_call>` (a possible partial tag is held back), then one streamer per call."""

    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""
        self._pos = 0
        self._call: CallStreamer | None = None

    def feed(self, delta: str) -> DeltaMessage:
        self._buffer += delta
        out = DeltaMessage()
        while self._step(out):
            pass
        return out

    def _step(self, out: DeltaMessage) -> bool:
        """Consume what can be consumed; True when another pass may make progress."""
        buf = self._buffer
        if self._call is None:
            start = buf.find(OPEN, self._pos)
            end = start if start >= 0 else len(buf) - partial_suffix(buf, OPEN)
            self._emit_content(buf[self._pos : end], out)
            self._pos = end
            if start < 0:
                return False
            self._pos += len(OPEN)
            self._call = CallStreamer(self.num_calls)
            return True
        close = buf.find(CLOSE, self._pos)
        body = buf[self._pos : close if close >= 0 else len(buf) - partial_suffix(buf, CLOSE)]
        if close < 0:
            out.tool_calls += self._call.update(body)
            return False
        self._close_call(body, out)
        self._pos = close + len(CLOSE)
        return True

    def _close_call(self, body: str, out: DeltaMessage) -> None:
        assert self._call is not None
        out.tool_calls += self._call.update(body)
        rest = self._call.finish(body)
        if rest is None and self._call.name is None:
            out.content += OPEN + body + CLOSE  # never announced as a call: hand it back as text
        else:
            out.tool_calls += rest or []
            self.num_calls += 1
        self._call = None

    def _emit_content(self, text: str, out: DeltaMessage) -> None:
        # Whitespace between or after calls is formatting, not content.
        if text and not (self.num_calls and not text.strip()):
            out.content += text

    def finish(self) -> DeltaMessage:
        out = DeltaMessage()
        if self._call is not None:  # the model stopped without closing the tag
            self._close_call(self._buffer[self._pos :], out)
        else:
            self._emit_content(self._buffer[self._pos :], out)
        self._pos = len(self._buffer)
        return out
