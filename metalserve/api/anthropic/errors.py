"""Anthropic's error shape: {"type": "error", "error": {"type": ..., "message": ...}}, in Anthropic's words
where its clients parse them (Claude Code reads the two context errors' numbers to recover by itself)."""

from __future__ import annotations

from typing import Any

from metalserve.api.errors import ContextLengthError, OpenAIError

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


def anthropic_message(exc: OpenAIError) -> str:
    """The message in Anthropic's wording: Claude Code retries with a smaller `max_tokens` on the first
    context error below and offers to compact the conversation on the second."""
    if isinstance(exc, ContextLengthError):
        if exc.requested is not None:
            return (
                f"input length and `max_tokens` exceed context limit: {exc.prompt_len} + {exc.requested} > "
                f"{exc.max_model_len}, decrease input length or `max_tokens` and try again"
            )
        return f"prompt is too long: {exc.prompt_len} tokens > {exc.max_model_len} maximum"
    return exc.message


def anthropic_error_body(exc: OpenAIError) -> dict[str, Any]:
    status = exc.status
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": anthropic_message(exc)}}
