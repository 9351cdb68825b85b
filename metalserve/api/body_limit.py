"""A request-body size limit whose 413 speaks the API's error format (Starlette's answers in plain text)."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from metalserve.api.errors import ErrorShapes, OpenAIError


def _too_large(limit: int) -> OpenAIError:
    return OpenAIError(f"the request body is larger than the server's limit of {limit} bytes", 413)


class BodyLimitMiddleware:
    """Refuse a declared Content-Length over the limit before reading a byte; a chunked body that grows
    past it fails its route with the same 413."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, shapes: ErrorShapes | None = None) -> None:
        self.app = app
        self.limit = max_body_bytes
        self.shapes = shapes or ErrorShapes()  # the 413 in the error format of the route asked for

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

        async def counted() -> Message:
            nonlocal total
            message = await receive()
            if message["type"] == "http.request":
                total += len(message.get("body", b""))
                if total > self.limit:
                    raise _too_large(self.limit)
            return message

        await self.app(scope, counted, send)
