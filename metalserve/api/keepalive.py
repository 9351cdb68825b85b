"""Streams that outlive a long prefill: a real protocol event whenever the model has been silent a while.

A CPU prefill of an agent's 10-20k-token prompt takes minutes, and both coding agents drop a stream that
sends no *event* for 5 minutes; neither counts keep-alive traffic outside its API's events:
- Claude Code resets its stream-idle timer on every SSE event but `ping` (its loop skips pings before it
  touches the timer); `CLAUDE_STREAM_IDLE_TIMEOUT_MS` can only raise the 300 s floor.
- Codex wraps each `next()` of its SSE event stream in `stream_idle_timeout_ms` (300 s by default);
  SSE comment lines never make an event, so they never reset it. Any event, of any type, does.
So every API sends an event of its own protocol that changes nothing in the answer (docs/agents.md):
Messages an empty `text_delta`, Responses a repeated `response.in_progress`, chat an empty content delta.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

# Seconds of silence before a keep-alive event; the agents' timeouts are 300 s, Anthropic pings every ~15 s.
KEEPALIVE_SECONDS = 10.0

T = TypeVar("T")


async def with_keepalive(items: AsyncIterator[T], interval: float | None = None) -> AsyncIterator[T | None]:
    """The items, with a None each time `interval` seconds (default KEEPALIVE_SECONDS, read per call so
    a test can shorten it) pass without one. Closing this closes `items` (aborting the requests behind)."""
    wait = KEEPALIVE_SECONDS if interval is None else interval
    pending: asyncio.Future[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(items.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=wait)
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
