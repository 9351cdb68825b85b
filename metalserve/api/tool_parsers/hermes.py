"""The Hermes / Qwen format, read as forgivingly as llama.cpp reads it.

The template asks for `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeatable. Small
models trained on it also write the call in other wrappers, and llama.cpp's server takes those too:

- an optional ```json / ```xml fence, an optional `<tool_call>`, `<function_call>`, `<tool>`, `<tools>`,
  `<response>`, `<json>`, `<xml>` or `<JSON>` tag, then a `{"name": "NAME", ...}` object; the fence and
  the tag, when written, are closed after the object (a closing cut off at the very end is let go);
- `<function=NAME>{...arguments...}</function>` and `<function name="NAME">{...}</function>`.

A fence after the last call, with only whitespace after it, belongs to the call: the call grammar lets any
closing follow a call, and the 1.5B coder model writes `</tools>` then a fence nothing opened (left as
text, that fence went back to the model as its answer in the next turn, and it wrote a lone fence again).

These loose forms count only for a tool the request declared (`for_request`): a ```json block about
anything else, or a call of a tool nobody offered, stays text. A `<tool_call>` block keeps its old
reading as well: any call object inside the tags, keys in any order, any name when no tools are known.
Text around the calls is content; a block that is not a call is content as the model wrote it.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import regex

from metalserve.api.tool_parsers.base import ParsedToolCall, Segment, ToolParser, parse_call_object, tool_schemas
from metalserve.api.tool_parsers.hermes_grammar import CALL_TAGS, FENCE_LANGS, hermes_call_grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_STARTS = "<`{"  # a call can only begin at one of these characters
# What starts at a position: a span (end, its call or None for text), "pending" (more text may decide),
# or None (no call starts here).
Found = tuple[int, ParsedToolCall | None] | Literal["pending"] | None


def head_pattern(names: list[str]) -> str:
    """The opening of a JSON-form call of one of `names`, up to the name's closing quote (shared with
    the lazy tool-call grammar, api/tool_grammar.py, so parser and grammar agree on what a call is)."""
    fence = r"(?P<fence>```(?:" + "|".join(FENCE_LANGS) + r")?\n\s*)?"
    tag = r"(?:<(?P<tag>" + "|".join(CALL_TAGS) + r")>)?"
    return fence + tag + r'\s*(?P<brace>\{)\s*"name"\s*:\s*"(?P<name>' + _alternatives(names) + ')"'


def function_pattern(names: list[str]) -> str:
    """`<function=NAME>` or `<function name="NAME">`."""
    alts = _alternatives(names)
    return r"<function(?:=(?P<fname>" + alts + r')>|\s+name="(?P<qname>' + alts + r')">)'


def _alternatives(names: list[str]) -> str:
    return "|".join(regex.escape(n) for n in sorted(names, key=len, reverse=True))


class HermesToolParser(ToolParser):
    name = "hermes"
    _loose: regex.Pattern[str] | None = None  # the loose forms, for the declared tools (for_request)

    def for_request(self, tools: list[Any] | None) -> HermesToolParser:
        parser = super().for_request(tools)
        assert isinstance(parser, HermesToolParser)
        names = sorted(parser.tool_names or ())
        parser._loose = regex.compile(f"{head_pattern(names)}|{function_pattern(names)}") if names else None
        return parser

    def call_grammar(self, tools: list[Any], *, parallel: bool, special_tokens: frozenset[str]) -> str | None:
        schemas = {name: schema for name, schema in tool_schemas(tools).items() if name}
        return hermes_call_grammar(schemas, parallel=parallel, special_tokens=special_tokens) if schemas else None

    def parse(self, text: str, final: bool) -> list[Segment]:
        segments: list[Segment] = []
        pos = scan = 0
        while True:
            start = _next_start(text, scan)
            if start < 0:
                segments.append(Segment(text[pos:]))
                return segments
            found: Found = self._loose_call(text, start, final)
            if found is None:
                found = self._tagged_call(text, start, final)
            if isinstance(found, str):  # "pending": may still become a call: nothing from here on is settled
                segments.append(Segment(text[pos:start]))
                return segments
            if found is None:
                scan = start + 1
                continue
            end, call = found
            calls = [call] if call is not None else []
            stray = _STRAY_FENCE.match(text, end, partial=not final) if call is not None else None
            if stray is not None:  # held while it may be a stray fence; one at the very end is the call's
                return [*segments, Segment(text[pos:start]), Segment(text[start:] if final else text[start:end], calls)]
            segments += [Segment(text[pos:start]), Segment(text[start:end], calls)]
            pos = scan = end

    def _loose_call(self, text: str, start: int, final: bool) -> Found:
        """A fenced, tagged, bare or `<function...>` call of a declared tool at `start`; "pending" while
        more text could make one; None when none starts here."""
        if self._loose is None:
            return None
        head = self._loose.match(text, start, partial=not final)
        if head is None:
            return None
        if head.partial:
            return "pending"
        json_form = head.group("name") is not None
        brace = head.start("brace") if json_form else _skip_space(text, head.end())
        try:
            obj, obj_end = _DECODER.raw_decode(text, brace)
        except ValueError:
            return None if final else "pending"
        if json_form:
            call = parse_call_object(text[brace:obj_end])
        else:
            name = head.group("fname") or head.group("qname")
            call = ParsedToolCall(name, text[brace:obj_end]) if isinstance(obj, dict) else None
        closing = regex.compile(_closing(head))
        tail = closing.match(text, obj_end, partial=True)
        if tail is None:
            return None
        if tail.partial and not final:
            return "pending"
        if call is None:
            return None
        return tail.end(), call

    def _tagged_call(self, text: str, start: int, final: bool) -> Found:
        """A `<tool_call>` block (any call object inside); its span as text when the body is no call."""
        if not text.startswith(OPEN, start):
            return "pending" if not final and OPEN.startswith(text[start:]) else None
        close = text.find(CLOSE, start + len(OPEN))
        if close < 0:  # unclosed: not settled yet; once the text is all there, a call object inside still counts
            return None if final else "pending"
        return close + len(CLOSE), parse_call_object(text[start + len(OPEN) : close])


_DECODER = json.JSONDecoder()


def _next_start(text: str, pos: int) -> int:
    found = [i for i in (text.find(c, pos) for c in _STARTS) if i >= 0]
    return min(found, default=-1)


# A fence after a call with only whitespace after it, to the end of the text.
_STRAY_FENCE = regex.compile(r"\s*```\s*\Z")


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _closing(head: regex.Match[str]) -> str:
    """What must follow the object: the tag's and the fence's closings, in that order."""
    if head.group("fname") or head.group("qname"):
        return r"\s*</function>"
    tag, fence = head.group("tag"), head.group("fence")
    return (rf"\s*</{tag}>" if tag else "") + (r"\s*```" if fence else "")


__all__ = ["CALL_TAGS", "CLOSE", "OPEN", "HermesToolParser", "function_pattern", "head_pattern"]
