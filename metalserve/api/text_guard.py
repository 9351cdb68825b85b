"""Refuse request bodies holding text that cannot be encoded (lone surrogates) before any route sees them.

JSON may spell a lone surrogate (`"\\ud800"`), and Python decodes it into a `str` that UTF-8 cannot
encode: the tokenizer, the prefix-cache hash and even the error response would fail on it later.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from fastapi.routing import APIRoute

from metalserve.api.errors import OpenAIError

# A `\uD800`-`\uDFFF` escape: the only way a JSON body can carry a surrogate. Valid pairs match too;
# they cost one parse and walk, which then finds nothing.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def first_unencodable(value: Any, path: str = "") -> str | None:
    """The dotted path of the first string (value or key) that UTF-8 cannot encode, else None."""
    if isinstance(value, str):
        return None if _encodable(value) else (path or "body")
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and not _encodable(key):
                return path or "body"
            where = f"{path}.{key}" if path else str(key)
            found = first_unencodable(item, where)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = first_unencodable(item, f"{path}.{i}" if path else str(i))
            if found is not None:
                return found
    return None


def check_body_text(body: bytes) -> None:
    """Raise a 400 naming the field when the JSON body holds a lone surrogate."""
    if not _SURROGATE_ESCAPE.search(body):
        return
    try:
        parsed = json.loads(body)
    except ValueError:
        return  # malformed JSON: the route's own parsing reports it
    path = first_unencodable(parsed)
    if path is not None:  # built from encodable keys only, so the error itself can be sent
        raise OpenAIError(f"{path}: text holds a lone surrogate (invalid Unicode)", 400, param=path)


class TextCheckedRoute(APIRoute):
    """An APIRoute that checks the body's text first; Starlette caches the body, so it is read once."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            if request.method in ("POST", "PUT", "PATCH"):
                check_body_text(await request.body())
            return await handler(request)

        return checked
