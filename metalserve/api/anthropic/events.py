"""Anthropic's streamed event sequence from the neutral deltas.

message_start, ping, then per block content_block_start / content_block_delta (text_delta,
thinking_delta, input_json_delta) / content_block_stop, then message_delta (stop_reason, usage)
and message_stop. A failure after the stream began is an `error` event.

While the prompt is still prefilling (api/keepalive.py), the stream starts early: message_start, then a
text block whose empty `text_delta`s reset Claude Code's idle timer (it skips `ping` before touching the
timer). The model's text continues that block; a call or thinking closes it empty and opens its own.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from metalserve.api.anthropic.errors import anthropic_error_body
from metalserve.api.anthropic.render import message_shell, stop_reason, tool_use_id, usage
from metalserve.api.deltas import ChoiceDelta, Segment, segments
from metalserve.api.keepalive import with_keepalive
from metalserve.api.serving_chat import Generation
from metalserve.api.serving_common import engine_error, merge_streams


def sse(kind: str, payload: dict[str, Any]) -> dict[str, str]:
    return {"event": kind, "data": json.dumps({"type": kind, **payload}, ensure_ascii=False)}


# The block a keep-alive opens before the model wrote anything: the first text segment adopts it.
_KEEPALIVE_BLOCK = ("keepalive", -1)


class _Blocks:
    """The open content block; a segment of another block closes it and opens its own."""

    def __init__(self, omit_thinking: bool) -> None:
        self.index = -1
        self.open: tuple[str, int] | None = None
        self.omit_thinking = omit_thinking  # thinking.display "omitted": the block stays empty

    def keepalive(self) -> list[dict[str, str]]:
        """An empty text_delta: in the keep-alive text block (opened by the first one), or the open block
        when it is text. A tool call's or thinking block's silence gets a `ping` (nothing else fits there)."""
        events = []
        if self.index == -1:
            self.index, self.open = 0, _KEEPALIVE_BLOCK
            events.append(sse("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}))
        if self.open is not None and self.open[0] in ("text", _KEEPALIVE_BLOCK[0]):
            empty = {"type": "text_delta", "text": ""}
            events.append(sse("content_block_delta", {"index": self.index, "delta": empty}))
        else:
            events.append(sse("ping", {}))
        return events

    def add(self, seg: Segment) -> list[dict[str, str]]:
        events = []
        if self.open == _KEEPALIVE_BLOCK and seg.kind == "text":
            self.open = seg.block  # the model's text goes on in the block the keep-alive opened
        if seg.block != self.open:
            events += self.close()
            self.index += 1
            self.open = seg.block
            events.append(sse("content_block_start", {"index": self.index, "content_block": _start_block(seg)}))
        delta = None if seg.kind == "reasoning" and self.omit_thinking else _delta(seg)
        if delta is not None:
            events.append(sse("content_block_delta", {"index": self.index, "delta": delta}))
        return events

    def close(self) -> list[dict[str, str]]:
        if self.open is None:
            return []
        self.open = None
        return [sse("content_block_stop", {"index": self.index})]


def _start_block(seg: Segment) -> dict[str, Any]:
    if seg.kind == "reasoning":
        return {"type": "thinking", "thinking": "", "signature": ""}
    if seg.kind == "text":
        return {"type": "text", "text": ""}
    return {"type": "tool_use", "id": tool_use_id(seg.tool_id or ""), "name": seg.tool_name, "input": {}}


def _delta(seg: Segment) -> dict[str, Any] | None:
    if seg.kind == "reasoning":
        return {"type": "thinking_delta", "thinking": seg.text}
    if seg.kind == "text":
        return {"type": "text_delta", "text": seg.text}
    return {"type": "input_json_delta", "partial_json": seg.text} if seg.text else None


async def message_events(gen: Generation, model: str, omit_thinking: bool) -> AsyncIterator[dict[str, str]]:
    """The whole event stream of one Messages request."""
    parser = gen.parsing.streamer(0)
    blocks = _Blocks(omit_thinking)
    started = False
    try:
        async for item in with_keepalive(merge_streams(gen.streams)):
            if item is None:
                if not started:  # still prefilling: the cached share is told by message_delta's usage
                    started = True
                    shell = message_shell(gen.request_id, model, usage(len(gen.prompt), 0, 0))
                    yield sse("message_start", {"message": shell})
                for event in blocks.keepalive():
                    yield event
                continue
            delta = parser.feed(item[1])
            if not started:  # after the first output, so the usage knows the cached prompt tokens
                started = True
                yield sse("message_start", {"message": message_shell(gen.request_id, model, _usage(delta, 0))})
                yield sse("ping", {})
            for seg in segments(delta):
                for event in blocks.add(seg):
                    yield event
            if delta.finished:
                for event in blocks.close():
                    yield event
                reason, sequence = stop_reason(delta.finish_reason, delta.stop_reason)
                end = {"stop_reason": reason, "stop_sequence": sequence}
                yield sse("message_delta", {"delta": end, "usage": _usage(delta, delta.num_output_tokens)})
                yield sse("message_stop", {})
    except Exception as exc:
        yield sse("error", {"error": anthropic_error_body(engine_error(exc))["error"]})


def _usage(delta: ChoiceDelta, output_tokens: int) -> dict[str, int]:
    return usage(delta.num_prompt_tokens, delta.num_cached_tokens, output_tokens)
