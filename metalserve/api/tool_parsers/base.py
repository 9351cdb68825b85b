"""Tool-call parsing: result types, the parser interface, and the one streamer every format shares.

A format implements only `parse(text, final)`: the text so far cut into settled segments, each plain
text or the calls one marked-up span holds. Everything else is here and the same for every format:
a call naming a tool the request did not offer, or whose arguments are not a JSON object that UTF-8
can encode, is handed back as the text the model wrote; streaming sends each segment once it is
settled; and `extract` (the non-streamed answer) is the streamer run over the whole text, so the two
agree on content, calls and finish reason for every output however it was cut into deltas.
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

CALL_NAME_RE = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
CALL_ARGS_RE = re.compile(r'"(?:arguments|parameters)"\s*:\s*(?=\S)')


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


@dataclass
class Segment:
    """A settled piece of the output: `text` is content, unless `calls` holds the calls it spells."""

    text: str
    calls: list[ParsedToolCall] = field(default_factory=list)


def make_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def parse_call_object(text: str) -> ParsedToolCall | None:
    """The call of one `{"name": ..., "arguments": {...}}` object's text, or None when it is not one."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ParsedToolCall(obj["name"], _arguments_text(text, args))


def _arguments_text(text: str, args: Any) -> str:
    """The arguments as the model wrote them when they are the object's last key, else re-serialized."""
    if isinstance(args, str):
        return args  # some models write the arguments as a JSON string already
    stripped = text.strip()
    name = CALL_NAME_RE.search(stripped)
    match = CALL_ARGS_RE.search(stripped, name.end() if name else len(stripped))
    if match is not None and stripped.endswith("}"):
        raw = stripped[match.end() : -1].rstrip()
        try:
            if raw and json.loads(raw) == args:
                return raw
        except ValueError:
            pass
    return json_text(args)


def call_is_valid(call: ParsedToolCall, tool_names: frozenset[str] | None) -> bool:
    """A call the client can run: a known tool (when the request listed tools), arguments a JSON object,
    and no text that UTF-8 cannot encode (a lone surrogate spelled as an escape)."""
    if not call.name or (tool_names is not None and call.name not in tool_names):
        return False
    try:
        value = json.loads(call.arguments)
        json.dumps(value, ensure_ascii=False).encode("utf-8")
        call.name.encode("utf-8")
    except (ValueError, UnicodeEncodeError):
        return False
    return isinstance(value, dict)


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `tag` (held back while streaming)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def hold_partial(text: str, markers: Iterable[str]) -> str:
    """`text` without an ending that could still grow into one of the markers."""
    cut = max((partial_suffix(text, m) for m in markers), default=0)
    return text[: len(text) - cut] if cut else text


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
    """A model family's tool-call format, given by `parse`; streaming and whole-text parsing follow."""

    name: str = ""
    # The format's markers are special tokens: the output must be detokenized with them kept.
    keeps_special_tokens: bool = False
    # End-of-sequence texts that show up when special tokens are kept; never content.
    end_markers: tuple[str, ...] = ()
    # The tools the request offered; None when not known (then any name is taken).
    tool_names: frozenset[str] | None = None

    @abstractmethod
    def parse(self, text: str, final: bool) -> list[Segment]:
        """The settled segments of `text`, in order. `final`: the text is all there is, so all of it is
        settled; else a trailing piece that may still grow into a marker or a call is left out.
        Settled segments never change as the text grows (only a trailing text segment may grow)."""

    def for_request(self, tools: list[Any] | None) -> ToolParser:
        """This parser for one request's tools: a call to any other name is content."""
        parser = copy.copy(self)
        parser.tool_names = frozenset(_tool_name(t) for t in tools) if tools else None
        return parser

    def call_grammar(self, tools: list[Any], *, parallel: bool, special_tokens: frozenset[str]) -> str | None:
        """A lazy grammar (llguidance Lark) that leaves text free and makes every call this parser reads
        valid for its tool's schema; None when the format has none (then `auto` output is unconstrained).
        `special_tokens`: the tokenizer's added tokens, which the grammar must name as tokens."""
        return None

    def segments(self, text: str, final: bool) -> list[Segment]:
        """`parse` with end markers cut, invalid calls turned back into text, and texts merged."""
        for marker in self.end_markers:
            text = text.removesuffix(marker)
        if not final:
            text = hold_partial(text, self.end_markers)
        merged: list[Segment] = []
        for seg in self.parse(text, final):
            calls = seg.calls if all(call_is_valid(c, self.tool_names) for c in seg.calls) else []
            if calls:
                merged.append(Segment(seg.text, calls))
            elif seg.text:
                if merged and not merged[-1].calls:
                    merged[-1] = Segment(merged[-1].text + seg.text)
                else:
                    merged.append(Segment(seg.text))
        return merged

    def streaming(self) -> StreamingToolParser:
        return SegmentStreamer(self)

    def extract(self, text: str) -> ExtractedToolCalls:
        """The whole text's content and calls: exactly what the streamer sends, put together."""
        streamer = self.streaming()
        content, calls = "", []
        for message in (streamer.feed(text), streamer.finish()):
            content += message.content
            calls += [
                ParsedToolCall(d.name or "", d.arguments, d.id or make_tool_call_id()) for d in message.tool_calls
            ]
        return ExtractedToolCalls(content or (None if calls else ""), calls)


def _tool_name(tool: Any) -> str:
    data = tool if isinstance(tool, dict) else tool.model_dump()
    return str((data.get("function") or data).get("name", ""))


def tool_schemas(tools: list[Any]) -> dict[str, dict[str, Any]]:
    """name -> parameters schema of a request's function tools (models or dicts); {} stands for none."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools:
        data = tool if isinstance(tool, dict) else tool.model_dump()
        function = data.get("function") or data
        schema = function.get("parameters")
        out[str(function.get("name", ""))] = schema if isinstance(schema, dict) else {}
    return out


class SegmentStreamer(StreamingToolParser):
    """Sends what `parse` settles, once. Whitespace next to a call is layout, not content: it is held
    back and dropped before a call, after the calls at the end, and at the start of a reply's content."""

    def __init__(self, parser: ToolParser) -> None:
        super().__init__()
        self._parser = parser
        self._text = ""
        self._sent: list[Segment] = []  # the settled segments already sent
        self._held = ""  # trailing whitespace of the content, not sent yet
        self._content_sent = False

    def feed(self, delta: str) -> DeltaMessage:
        self._text += delta
        return self._emit(self._parser.segments(self._text, False))

    def finish(self) -> DeltaMessage:
        out = self._emit(self._parser.segments(self._text, True))
        if not self.num_calls:
            out.content += self._held
        self._held = ""
        return out

    def _emit(self, segments: list[Segment]) -> DeltaMessage:
        out = DeltaMessage()
        for i, seg in enumerate(segments):
            known = self._sent[i] if i < len(self._sent) else None
            if seg.calls:
                if known is None:
                    self._held = ""
                    for call in seg.calls:
                        out.tool_calls.append(ToolCallDelta(self.num_calls, call.id, call.name, call.arguments))
                        self.num_calls += 1
            elif known is None or known.text != seg.text:
                new = seg.text[len(known.text) :] if known is not None else seg.text
                out.content += self._content(new)
        self._sent = segments
        return out

    def _content(self, text: str) -> str:
        text = self._held + text
        if self.num_calls and not self._content_sent:
            text = text.lstrip()
        body = text.rstrip()
        self._held = text[len(body) :]
        self._content_sent = self._content_sent or bool(body)
        return body
