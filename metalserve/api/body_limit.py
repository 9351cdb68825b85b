"""Request-body limits whose errors speak the API's format (Starlette's answers in plain text): a size
limit (413) and a time limit for the body to arrive (408), so a Content-Length larger than the bytes
sent cannot hold a connection (and its task) open forever."""

from __future__ import annotations

import asyncio
import time

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from metalserve.api.errors import ErrorShapes, OpenAIError

DEFAULT_BODY_TIMEOUT_S = 30.0


def _too_large(limit: int) -> OpenAIError:
    return OpenAIError(f"the request body is larger than the server's limit of {limit} bytes", 413)


def _too_slow(timeout: float) -> OpenAIError:
    return OpenAIError(f"the request body did not arrive within {timeout:g} s (--request-body-timeout)", 408)


class BodyLimitMiddleware:
    """Refuse a declared Content-Length over the limit before reading a byte; a chunked body that grows
    past it fails its route with the same 413. The whole body must arrive within `body_timeout` seconds
    of the first read; after the body, reads (a route waiting for a disconnect) are not timed."""

    def __init__(
        self,
        app: ASGIApp,
        max_body_bytes: int,
        shapes: ErrorShapes | None = None,
        body_timeout: float = DEFAULT_BODY_TIMEOUT_S,
    ) -> None:
        self.app = app
        self.limit = max_body_bytes
        self.shapes = shapes or ErrorShapes()  # the error in the format of the route asked for
        self.body_timeout = body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            response = self.shapes.response(scope["path"], _too_large(self.limit), headers={"Connection": "close"})
            await response(scope, receive, send)
            return
        total = 0
        body_done = False
        deadline: float | None = None
        cut_short = False  # the body did not arrive whole: the connection cannot be reused

        async def counted() -> Message:
            nonlocal total, body_done, deadline
            if body_done:
                return await receive()
            if deadline is None:
                deadline = time.monotonic() + self.body_timeout
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                nonlocal cut_short
                cut_short = True
                raise _too_slow(self.body_timeout) from None
            if message["type"] == "http.request":
                total += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if total > self.limit:
                    raise _too_large(self.limit)
            else:
                body_done = True
            return message

        async def closing(message: Message) -> None:
            if cut_short and message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, counted, closing)
