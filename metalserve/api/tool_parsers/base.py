"""Tool-call parsing: the result types, the parser interfaces, and a streamer for one JSON call object."""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

_NAME_RE = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
# The lookahead waits for the value's first character, so a space still to come is not in the arguments.
_ARGS_RE = re.compile(r'"(?:arguments|parameters)"\s*:\s*(?=\S)')
_HELD_BACK = " \t\r\n}"


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # a JSON text
    id: str = field(default_factory=lambda: make_tool_call_id())


@dataclass
class ExtractedToolCalls:
    content: str | None
    calls: list[ParsedToolCall]


@dataclass
class ToolCallDelta:
    """One piece of a streamed call; the first piece of each index carries its id and name."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class DeltaMessage:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


def make_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_call_object(text: str) -> tuple[str, str] | None:
    """(name, arguments JSON) from one call object's text, or None when it is not a tool call."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], _arguments_text(text, args)


def _arguments_text(text: str, args: Any) -> str:
    """The arguments as the model wrote them when they are the object's last key, else re-serialized."""
    if isinstance(args, str):
        return args  # some models write the arguments as a JSON string already
    stripped = text.strip()
    match = _ARGS_RE.search(stripped, _name_end(stripped))
    if match is not None and stripped.endswith("}"):
        raw = stripped[match.end() : -1].rstrip()
        try:
            if raw and json.loads(raw) == args:
                return raw
        except ValueError:
            pass
    return json.dumps(args, ensure_ascii=False)


def _name_end(text: str) -> int:
    match = _NAME_RE.search(text)
    return match.end() if match else len(text)


class CallStreamer:
    """Streams one `{"name": ..., "arguments": {...}}` object while it grows.

    The name goes out as soon as it is complete; the arguments go out as the raw text the model
    writes, holding back trailing whitespace and braces (they may be the object's own closing brace).
    """

    def __init__(self, index: int) -> None:
        self.index = index
        self.id = make_tool_call_id()
        self.name: str | None = None
        self._args_start: int | None = None
        self._sent = ""

    def update(self, text: str) -> list[ToolCallDelta]:
        deltas: list[ToolCallDelta] = []
        if self.name is None:
            match = _NAME_RE.search(text)
            if match is None:
                return deltas
            self.name = json.loads(f'"{match.group(1)}"')
            deltas.append(ToolCallDelta(self.index, self.id, self.name, ""))
            args = _ARGS_RE.search(text, match.end())
            self._args_start = args.end() if args else None
        if self._args_start is None:
            args = _ARGS_RE.search(text, _name_end(text))
            self._args_start = args.end() if args else None
        if self._args_start is not None:
            safe = text[self._args_start :].rstrip(_HELD_BACK)
            if len(safe) > len(self._sent) and safe.startswith(self._sent):
                deltas.append(ToolCallDelta(self.index, arguments=safe[len(self._sent) :]))
                self._sent = safe
        return deltas

    def finish(self, text: str) -> list[ToolCallDelta] | None:
        """The rest of the call once its text is complete; None when the text is not a tool call."""
        parsed = parse_call_object(text)
        if parsed is None:
            return None
        name, arguments = parsed
        if self.name is None:
            self.name = name
            return [ToolCallDelta(self.index, self.id, name, arguments)]
        rest = arguments[len(self._sent) :] if arguments.startswith(self._sent) else ""
        return [ToolCallDelta(self.index, arguments=rest)] if rest else []


class StreamingToolParser(ABC):
    """Turns text deltas into content and tool-call deltas for one choice."""

    def __init__(self) -> None:
        self.num_calls = 0

    @property
    def tools_called(self) -> bool:
        return self.num_calls > 0

    @abstractmethod
    def feed(self, delta: str) -> DeltaMessage: ...

    @abstractmethod
    def finish(self) -> DeltaMessage: ...


class ToolParser(ABC):
    """A model family's tool-call format: parse a whole text, or make a streaming parser."""

    name: str = ""
    # The format's markers are special tokens: the output must be detokenized with them kept.
    keeps_special_tokens: bool = False

    def for_request(self, tools: list[Any] | None) -> ToolParser:
        """The parser for one request's tools (formats that type arguments by the schema need them)."""
        return self

    @abstractmethod
    def extract(self, text: str) -> ExtractedToolCalls: ...

    @abstractmethod
    def streaming(self) -> StreamingToolParser: ...


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `tag` (held back while streaming)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
