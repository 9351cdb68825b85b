"""A streaming parser for any format with a `parse(text, final)`: re-parse the text so far, send the rest.

Content goes out as soon as the format says it is settled (a possible partial marker is held back);
each call goes out whole (id, name and arguments in one delta) as soon as it is complete.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any

from metalserve.api.tool_parsers.base import (
    DeltaMessage,
    ExtractedToolCalls,
    ParsedToolCall,
    StreamingToolParser,
    ToolCallDelta,
    ToolParser,
)


@dataclass
class Parsed:
    """What a text says so far: settled content, and the calls that are complete."""

    content: str
    calls: list[ParsedToolCall] = field(default_factory=list)


class ReparsingToolParser(ToolParser):
    """A format given by one `parse`; `extract` and `streaming` follow from it."""

    # End-of-sequence texts that show up when special tokens are kept; never content.
    end_markers: tuple[str, ...] = ()

    def settled(self, text: str, final: bool) -> Parsed:
        """`parse`, with an end-of-sequence marker (or, while streaming, its start) cut off the content."""
        parsed = self.parse(text, final)
        for marker in self.end_markers:
            parsed.content = parsed.content.removesuffix(marker)
        if not final:
            parsed.content = hold_partial(parsed.content, self.end_markers)
        return parsed

    @abstractmethod
    def parse(self, text: str, final: bool) -> Parsed:
        """`final`: the text is all there is (else a trailing piece may still grow into a marker or a call).
        The content of a prefix must be a prefix of the content of the whole."""

    def extract(self, text: str) -> ExtractedToolCalls:
        parsed = self.settled(text, True)
        if not parsed.calls:  # no well-formed call: all of it is content (as the model wrote it)
            for marker in self.end_markers:
                text = text.removesuffix(marker)
            return ExtractedToolCalls(text, [])
        return ExtractedToolCalls(parsed.content.strip() or None, parsed.calls)

    def streaming(self) -> StreamingToolParser:
        return ReparsingStreamer(self)


class ReparsingStreamer(StreamingToolParser):
    def __init__(self, parser: ReparsingToolParser) -> None:
        super().__init__()
        self._parser = parser
        self._text = ""
        self._sent = ""

    def feed(self, delta: str) -> DeltaMessage:
        self._text += delta
        return self._emit(self._parser.settled(self._text, False))

    def finish(self) -> DeltaMessage:
        parsed = self._parser.settled(self._text, True)
        if not parsed.calls and not self.num_calls:  # no call after all: the held text is content, as in extract
            parsed.content = self._parser.extract(self._text).content or ""
        return self._emit(parsed)

    def _emit(self, parsed: Parsed) -> DeltaMessage:
        out = DeltaMessage()
        if parsed.content.startswith(self._sent):
            out.content = parsed.content[len(self._sent) :]
            self._sent = parsed.content
        for call in parsed.calls[self.num_calls :]:
            out.tool_calls.append(ToolCallDelta(self.num_calls, call.id, call.name, call.arguments))
            self.num_calls += 1
        return out


def hold_partial(text: str, markers: tuple[str, ...]) -> str:
    """`text` without an ending that could still grow into one of the markers."""
    cut = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:n]):
                cut = max(cut, n)
                break
    return text[: len(text) - cut] if cut else text


def json_text(value: Any) -> str:
    import json

    return json.dumps(value, ensure_ascii=False)
