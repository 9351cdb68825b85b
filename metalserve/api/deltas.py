"""The API-neutral output side: an engine request's deltas split into reasoning, answer text and tool calls.

Chat chunks, Anthropic events and Responses events are three renderings of the same `ChoiceDelta`s
(streamed) or of one `FinalOutput` (not streamed); only the rendering differs between the API families.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from metalserve.api.reasoning import ReasoningParser, ReasoningStreamer
from metalserve.api.tool_choice import ForcedToolStreamer
from metalserve.api.tool_parsers import ParsedToolCall, StreamingToolParser, ToolCallDelta, ToolParser
from metalserve.api.tool_parsers.base import make_tool_call_id
from metalserve.engine.async_engine import RequestOutput
from metalserve.outputs import TokenLogprob


@dataclass
class ChoiceDelta:
    """What one engine output adds to a choice; `finish_reason` is "tool_calls" once calls were made."""

    index: int
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class FinalOutput:
    """A whole choice: reasoning (None without a reasoning parser), answer text and parsed calls."""

    reasoning: str | None
    content: str | None
    tool_calls: list[ParsedToolCall]
    finish_reason: str | None


@dataclass(frozen=True)
class OutputParsing:
    """How a request's output is split: which parsers apply, and whether only one call is kept."""

    reasoning: ReasoningParser | None = None
    tools: ToolParser | None = None  # None: tool calls are not parsed (no tools, or tool_choice none)
    forced: Any = None  # a forced tool_choice ("required" or named): the grammar's output is the calls
    prompt_tail: str = ""
    single_call: bool = False  # parallel_tool_calls false

    def streamer(self, index: int) -> ChoiceParser:
        reasoning = self.reasoning.streaming(self.prompt_tail) if self.reasoning else None
        return ChoiceParser(index, reasoning, self._tool_streamer(), self.single_call)

    def _tool_streamer(self) -> StreamingToolParser | None:
        if self.forced is not None:
            return ForcedToolStreamer(self.forced)
        return self.tools.streaming() if self.tools is not None else None

    def final(self, text: str, finish_reason: str | None) -> FinalOutput:
        """The non-streamed split of a whole output text: the tool streamer's deltas put together, so a
        streamed and a non-streamed answer never differ in content, calls or finish reason."""
        reasoning: str | None = None
        if self.reasoning is not None:
            split = self.reasoning.split(text, self.prompt_tail)
            reasoning, text = split.reasoning, split.content
        tools = self._tool_streamer()
        if tools is None:
            return FinalOutput(reasoning, text, [], finish_reason)
        content, calls = "", {}
        for message in (tools.feed(text), tools.finish()):
            content += message.content
            for d in message.tool_calls:
                if d.index not in calls:
                    calls[d.index] = ParsedToolCall(d.name or "", "", d.id or make_tool_call_id())
                calls[d.index].arguments += d.arguments
        if not calls:
            return FinalOutput(reasoning, content, [], finish_reason)
        reason = "tool_calls" if finish_reason == "stop" else finish_reason
        kept = [calls[0]] if self.single_call else [calls[i] for i in sorted(calls)]
        return FinalOutput(reasoning, content or None, kept, reason)


class ChoiceParser:
    """Streams one choice: reasoning first (when a reasoning parser is set), then the tool parser."""

    def __init__(
        self,
        index: int,
        reasoning: ReasoningStreamer | None,
        tools: StreamingToolParser | None,
        single_call: bool = False,
    ) -> None:
        self.index = index
        self.reasoning = reasoning
        self.tools = tools
        self.single_call = single_call

    def feed(self, out: RequestOutput) -> ChoiceDelta:
        delta = ChoiceDelta(
            self.index,
            stop_reason=out.stop_reason,
            logprobs=out.logprobs,
            num_prompt_tokens=out.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
            num_output_tokens=out.num_output_tokens,
        )
        text = out.text
        if self.reasoning is not None:
            split = self.reasoning.feed(text)
            if out.finished:
                rest = self.reasoning.finish()
                split.reasoning += rest.reasoning
                split.content += rest.content
            delta.reasoning, text = split.reasoning, split.content
        reason = out.finish_reason
        if self.tools is None:
            delta.content = text
        else:
            message = self.tools.feed(text)
            if out.finished:
                end = self.tools.finish()
                message.content += end.content
                message.tool_calls += end.tool_calls
                if self.tools.tools_called and reason == "stop":
                    reason = "tool_calls"
            delta.content = message.content
            calls = message.tool_calls
            delta.tool_calls = [c for c in calls if c.index == 0] if self.single_call else calls
        delta.finish_reason = reason
        return delta


@dataclass
class Segment:
    """One piece of a delta in output order: reasoning text, answer text, or a tool call's start/arguments."""

    kind: str  # "reasoning" | "text" | "tool"
    text: str = ""  # the text, or the call's arguments so far
    tool_index: int = -1
    tool_id: str | None = None  # set on a call's first segment, with its name
    tool_name: str | None = None

    @property
    def block(self) -> tuple[str, int]:
        """Segments with the same block key belong to one output block (content block / output item)."""
        return self.kind, self.tool_index


def segments(delta: ChoiceDelta) -> list[Segment]:
    """The delta's non-empty pieces in the order the model wrote them: reasoning, text, then calls."""
    out: list[Segment] = []
    if delta.reasoning:
        out.append(Segment("reasoning", delta.reasoning))
    if delta.content:
        out.append(Segment("text", delta.content))
    for call in delta.tool_calls:
        if call.id is not None or call.arguments:
            out.append(Segment("tool", call.arguments, call.index, call.id, call.name))
    return out
