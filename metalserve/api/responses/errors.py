"""Errors of the Responses API: OpenAI's shape, with `param` and the message naming that API's fields
(`input`, `max_output_tokens`), never the chat fields the request was translated to."""

from __future__ import annotations

from typing import Any

from metalserve.api.errors import ContextLengthError, OpenAIError, error_body

# Chat-form field -> the Responses field it came from (api/responses/translate.py).
_PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "chat_template_kwargs": "reasoning",
}


def responses_param(param: str | None) -> str | None:
    if param is None:
        return None
    head, dot, rest = param.partition(".")
    return _PARAMS.get(head, head) + dot + rest


def responses_message(exc: OpenAIError) -> str:
    if isinstance(exc, ContextLengthError) and exc.requested is not None:
        return exc.message.replace("'max_tokens'", "'max_output_tokens'")
    return exc.message


def responses_error_body(exc: OpenAIError) -> dict[str, Any]:
    return error_body(responses_message(exc), exc.status, param=responses_param(exc.param), code=exc.code)
