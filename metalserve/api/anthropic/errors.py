"""Anthropic's error shape: {"type": "error", "error": {"type": ..., "message": ...}}."""

from __future__ import annotations

from typing import Any

from metalserve.api.errors import OpenAIError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_body(exc: OpenAIError) -> dict[str, Any]:
    status = exc.status
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}
