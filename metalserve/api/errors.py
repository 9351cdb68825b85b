"""Errors in the OpenAI format: {"error": {"message", "type", "param", "code"}} with a matching status.

Other API families render the same OpenAIError in their own shape: `ErrorShapes` maps a path prefix
to a renderer, and every handler here (validation errors included) asks it.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    500: "internal_server_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}
# Statuses a retry cannot fix: `x-should-retry: false` tells the OpenAI and Anthropic SDKs (and the agents
# built on them) to fail at once instead of backing off for minutes (a wrong key retried ~3 min otherwise).
NON_RETRYABLE = frozenset({400, 401, 403, 404, 405, 413, 415, 422})
# Statuses worth retrying after a pause: `retry-after` (seconds) says how long.
RETRY_AFTER_SECONDS = {429: 1, 503: 5}


class OpenAIError(Exception):
    """An error the client should see, with its HTTP status.

    `param` names the request field in the chat API's words; other API families map it (see ErrorShapes).
    """

    def __init__(self, message: str, status: int = 400, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code

    def to_dict(self) -> dict[str, Any]:
        return error_body(self.message, self.status, param=self.param, code=self.code)


def error_body(message: str, status: int, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    err_type = _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error")
    return {"error": {"message": message, "type": err_type, "param": param, "code": code or str(status)}}


class ContextLengthError(OpenAIError):
    """The prompt (or prompt + max_tokens) does not fit the context: each API words it as its clients parse.

    `requested` is None when the prompt alone is too long; `at_least` when the count is a lower bound
    (a text refused by its length before tokenizing)."""

    def __init__(
        self, prompt_len: int, max_model_len: int, requested: int | None = None, *, at_least: bool = False
    ) -> None:
        self.prompt_len, self.max_model_len, self.requested = prompt_len, max_model_len, requested
        if requested is None:
            least = "at least " if at_least else ""
            message = (
                f"This model's maximum context length is {max_model_len} tokens. However, your request has "
                f"{least}{prompt_len} input tokens. Please reduce the length of the input."
            )
            param = "messages"
        else:
            message = (
                f"'max_tokens' is too large: {requested}. This model's maximum context length is "
                f"{max_model_len} tokens and your request has {prompt_len} input tokens "
                f"({requested} > {max_model_len} - {prompt_len})."
            )
            param = "max_tokens"
        super().__init__(message, 400, param=param, code="context_length_exceeded")


def retry_headers(status: int) -> dict[str, str]:
    """The retry advice for a status: `x-should-retry: false`, or `retry-after` with a pause."""
    if status in NON_RETRYABLE:
        return {"x-should-retry": "false"}
    if status in RETRY_AFTER_SECONDS:
        return {"retry-after": str(RETRY_AFTER_SECONDS[status])}
    return {}


def log_client_error(path: str, exc: OpenAIError) -> None:
    """One log line with the reason for every 4xx (the access log shows only the status)."""
    if 400 <= exc.status < 500:
        logger.info("%d on %s: %s%s", exc.status, path, exc.message, f" (param {exc.param})" if exc.param else "")


ErrorRenderer = Callable[[OpenAIError], dict[str, Any]]


class ErrorShapes:
    """The error body for a path: the first matching prefix's renderer, else the OpenAI shape."""

    def __init__(self, renderers: Sequence[tuple[str, ErrorRenderer]] = ()) -> None:
        self.renderers = list(renderers)

    def body(self, path: str, exc: OpenAIError) -> dict[str, Any]:
        for prefix, render in self.renderers:
            if path == prefix or path.startswith(prefix + "/"):
                return render(exc)
        return exc.to_dict()

    def response(self, path: str, exc: OpenAIError, headers: dict[str, str] | None = None) -> JSONResponse:
        """The error response, with its retry advice; every 4xx is logged with its reason."""
        log_client_error(path, exc)
        all_headers = {**retry_headers(exc.status), **(headers or {})}
        return JSONResponse(self.body(path, exc), status_code=exc.status, headers=all_headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    # Of a union's alternatives, the one that got furthest says what is wrong ("input.0.call_id: Field
    # required", not "input.str: Input should be a valid string"); its branch names are left out.
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    loc = [str(part) for part in first.get("loc", ()) if part != "body" and "[" not in str(part)]
    param = ".".join(loc) or None
    message = str(first.get("msg", "invalid value"))
    return (f"{param}: {message}" if param else message), param


def install_error_handlers(app: FastAPI, shapes: ErrorShapes | None = None) -> None:
    """Map validation errors to 400, HTTP errors to their status, anything else to a logged 500."""
    shapes = shapes or ErrorShapes()

    @app.exception_handler(OpenAIError)
    async def _openai(request: Request, exc: OpenAIError) -> JSONResponse:
        return shapes.response(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return await _openai(request, OpenAIError(message, 400, param=param))

    @app.exception_handler(ValidationError)
    async def _pydantic(request: Request, exc: ValidationError) -> JSONResponse:
        return await _validation(request, RequestValidationError(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return await _openai(request, OpenAIError(str(exc.detail), exc.status_code))

    @app.exception_handler(json.JSONDecodeError)
    async def _json(request: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return await _openai(request, OpenAIError(f"malformed JSON body: {exc}", 400))

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect) -> Response:
        # A client that leaves is routine: a debug line, no traceback, and an answer nobody reads.
        logger.debug("client disconnected during %s %s", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        return await _openai(request, internal_error(exc))


def internal_error(exc: BaseException) -> OpenAIError:
    """A 500 whose body names a log reference, never the exception's own text (it may hold internals)."""
    ref = uuid.uuid4().hex[:12]
    logger.error("internal error (ref %s)", ref, exc_info=exc)
    return OpenAIError(f"internal server error (ref {ref}; the server log has the details)", 500)
