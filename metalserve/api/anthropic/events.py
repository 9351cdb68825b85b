"""Anthropic's streamed event sequence from the neutral deltas.

message_start, ping, then per block content_block_start / content_block_delta (text_delta,
thinking_delta, input_json_delta) / content_block_stop, then message_delta (stop_reason, usage)
and message_stop. A failure after the stream began is an `error` event.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from metalserve.api.anthropic.errors import anthropic_error_body
from metalserve.api.anthropic.render import message_shell, stop_reason, tool_use_id, usage
from metalserve.api.deltas import ChoiceDelta, Segment, segments
from metalserve.api.serving_chat import Generation
from metalserve.api.serving_common import engine_error, merge_streams


def sse(kind: str, payload: dict[str, Any]) -> dict[str, str]:
    return {"event": kind, "data": json.dumps({"type": kind, **payload}, ensure_ascii=False)}


class _Blocks:
    """The open content block; a segment of another block closes it and opens its own."""

    def __init__(self, omit_thinking: bool) -> None:
        self.index = -1
        self.open: tuple[str, int] | None = None
        self.omit_thinking = omit_thinking  # thinking.display "omitted": the block stays empty

    def add(self, seg: Segment) -> list[dict[str, str]]:
        events = []
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


# A long prefill sends nothing for minutes; Claude Code drops a stream idle for 5 minutes. So after this
# many seconds without output the stream starts and `ping` events keep it alive, as Anthropic's API does.
HEARTBEAT_SECONDS = 10.0

T = TypeVar("T")


async def with_heartbeat(items: AsyncIterator[T], interval: float) -> AsyncIterator[T | None]:
    """The items, with a None each time `interval` seconds pass without one."""
    pending: asyncio.Future[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(items.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield None
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            finally:
                pending = None
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        closing = getattr(items, "aclose", None)  # so the engine requests behind it are aborted now
        if closing is not None:
            await closing()


async def message_events(gen: Generation, model: str, omit_thinking: bool) -> AsyncIterator[dict[str, str]]:
    """The whole event stream of one Messages request."""
    parser = gen.parsing.streamer(0)
    blocks = _Blocks(omit_thinking)
    started = False
    try:
        async for item in with_heartbeat(merge_streams(gen.streams), HEARTBEAT_SECONDS):
            if item is None:
                if not started:  # still prefilling: the cached share is told by message_delta's usage
                    started = True
                    shell = message_shell(gen.request_id, model, usage(len(gen.prompt), 0, 0))
                    yield sse("message_start", {"message": shell})
                yield sse("ping", {})
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
