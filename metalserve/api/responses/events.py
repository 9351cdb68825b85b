"""The Responses API's streamed events from the neutral deltas, each with its sequence_number.

response.created, response.in_progress; per output item output_item.added, then for text
content_part.added / output_text.delta / output_text.done / content_part.done, for reasoning the
same with reasoning_text, for calls function_call_arguments.delta / .done; output_item.done;
then response.completed (or response.incomplete when max_output_tokens ran out).

While the model is silent (a long prefill), `response.in_progress` is sent again every few seconds
(api/keepalive.py): Codex resets its stream-idle timer on any event, never on an SSE comment. Those
repeats are keep-alives and stay small: their response object keeps every key the protocol requires but
not the echo of the request's bulk (`instructions` null, `tools` empty: 20 KB for Codex, every 10 s);
response.created, the first response.in_progress and the final event carry the whole object.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from metalserve.api.deltas import ChoiceDelta, Segment, segments
from metalserve.api.keepalive import with_keepalive
from metalserve.api.responses import render
from metalserve.api.responses.errors import responses_error_body
from metalserve.api.serving_chat import Generation
from metalserve.api.serving_common import engine_error, merge_streams

Finish = Callable[[ChoiceDelta, list[dict[str, Any]], str], dict[str, Any]]


class ResponseEvents:
    """Renders one response's stream; `output` holds the finished items for the final object."""

    def __init__(self, shell: dict[str, Any], summary: bool, namespaces: dict[str, str]) -> None:
        self.shell = shell
        self.summary = summary
        self.namespaces = namespaces
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.reasoning_text = ""
        self._open: tuple[str, int] | None = None
        self._item: dict[str, Any] = {}
        self._text = ""

    def event(self, kind: str, **payload: Any) -> dict[str, str]:
        body = {"type": kind, **payload, "sequence_number": self.sequence}
        self.sequence += 1
        return {"event": kind, "data": json.dumps(body, ensure_ascii=False)}

    def add(self, seg: Segment) -> list[dict[str, str]]:
        events = []
        if seg.block != self._open:
            events += self.close()
            events += self._start(seg)
        self._text += seg.text
        where = {"item_id": self._item["id"], "output_index": len(self.output)}
        if seg.kind == "text":
            events.append(
                self.event("response.output_text.delta", **where, content_index=0, delta=seg.text, logprobs=[])
            )
        elif seg.kind == "reasoning":
            events.append(self.event("response.reasoning_text.delta", **where, content_index=0, delta=seg.text))
        elif seg.text:
            events.append(self.event("response.function_call_arguments.delta", **where, delta=seg.text))
        return events

    def _start(self, seg: Segment) -> list[dict[str, str]]:
        self._open, self._text = seg.block, ""
        if seg.kind == "text":
            self._item = render.message_item(render.item_id("msg"), None, "in_progress")
            part = render.output_text("")
        elif seg.kind == "reasoning":
            self._item = render.reasoning_item(render.item_id("rs"), "", False, "in_progress")
            part = {"type": "reasoning_text", "text": ""}
        else:
            fid, call_id = render.item_id("fc"), seg.tool_id or render.item_id("call")
            name = seg.tool_name or ""
            namespace = self.namespaces.get(name)
            self._item = render.function_call_item(fid, call_id, name, "", "in_progress", namespace)
            return [self.event("response.output_item.added", output_index=len(self.output), item=self._item)]
        where = {"item_id": self._item["id"], "output_index": len(self.output)}
        return [
            self.event("response.output_item.added", output_index=len(self.output), item=self._item),
            self.event("response.content_part.added", **where, content_index=0, part=part),
        ]

    def close(self) -> list[dict[str, str]]:
        if self._open is None:
            return []
        kind, text, item = self._open[0], self._text, self._item
        where = {"item_id": item["id"], "output_index": len(self.output)}
        events = []
        if kind == "text":
            done = render.message_item(item["id"], text)
            events.append(self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]))
            events.append(
                self.event("response.content_part.done", **where, content_index=0, part=render.output_text(text))
            )
        elif kind == "reasoning":
            self.reasoning_text += text
            done = render.reasoning_item(item["id"], text, self.summary)
            part = {"type": "reasoning_text", "text": text}
            events.append(self.event("response.reasoning_text.done", **where, content_index=0, text=text))
            events.append(self.event("response.content_part.done", **where, content_index=0, part=part))
        else:
            namespace = item.get("namespace")
            done = render.function_call_item(item["id"], item["call_id"], item["name"], text, namespace=namespace)
            events.append(
                self.event("response.function_call_arguments.done", **where, name=item["name"], arguments=text)
            )
        events.append(self.event("response.output_item.done", output_index=len(self.output), item=done))
        self.output.append(done)
        self._open = None
        return events


async def response_events(gen: Generation, renderer: ResponseEvents, finish: Finish) -> AsyncIterator[dict[str, str]]:
    """The whole stream; `finish` builds (and stores) the final response object from the last delta."""
    shell = renderer.shell
    yield renderer.event("response.created", response=shell)
    yield renderer.event("response.in_progress", response=shell)
    keepalive = {**shell, "instructions": None, "tools": []}
    parser = gen.parsing.streamer(0)
    try:
        async for item in with_keepalive(merge_streams(gen.streams)):
            if item is None:
                yield renderer.event("response.in_progress", response=keepalive)
                continue
            delta = parser.feed(item[1])
            for seg in segments(delta):
                for event in renderer.add(seg):
                    yield event
            if delta.finished:
                for event in renderer.close():
                    yield event
                body = finish(delta, renderer.output, renderer.reasoning_text)
                kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
                yield renderer.event(kind, response=body)
    except Exception as exc:
        error = engine_error(exc)
        body = responses_error_body(error)["error"]
        yield renderer.event("error", code=body["code"], message=body["message"], param=body["param"])
