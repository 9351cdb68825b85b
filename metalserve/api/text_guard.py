"""Refuse request bodies holding text that cannot be encoded (lone surrogates), or numbers JSON does not
have (NaN, Infinity), before any route sees them.

JSON may spell a lone surrogate (`"\\ud800"`), and Python decodes it into a `str` that UTF-8 cannot
encode: the tokenizer, the prefix-cache hash and even the error response would fail on it later.
Python's JSON reader also takes `NaN` and `Infinity`, which no JSON writer may send back: a body echoing
one (a Responses answer repeats the request's tools) could not be written.
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
# Python's names for the numbers JSON lacks; inside strings they match too and cost one parse.
_NON_FINITE = re.compile(rb"NaN|Infinity")
_NOT_A_NUMBER = object()  # what the parse makes of NaN, Infinity and -Infinity


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


def first_non_finite(value: Any, path: str = "") -> str | None:
    """The dotted path of the first NaN or Infinity (as `_NOT_A_NUMBER`), else None."""
    if value is _NOT_A_NUMBER:
        return path or "body"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = first_non_finite(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def check_body_text(body: bytes) -> None:
    """Raise a 400 naming the field when the JSON body holds a lone surrogate, NaN or Infinity."""
    surrogate, non_finite = _SURROGATE_ESCAPE.search(body), _NON_FINITE.search(body)
    if not surrogate and not non_finite:
        return
    try:
        parsed = json.loads(body, parse_constant=lambda _name: _NOT_A_NUMBER)
    except ValueError:
        return  # malformed JSON: the route's own parsing reports it
    path = first_unencodable(parsed) if surrogate else None
    if path is not None:  # built from encodable keys only, so the error itself can be sent
        raise OpenAIError(f"{path}: text holds a lone surrogate (invalid Unicode)", 400, param=path)
    path = first_non_finite(parsed) if non_finite else None
    if path is not None:
        raise OpenAIError(f"{path}: NaN and Infinity are not JSON numbers", 400, param=path)


class TextCheckedRoute(APIRoute):
    """An APIRoute that checks the body's text first; Starlette caches the body, so it is read once."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            if request.method in ("POST", "PUT", "PATCH"):
                check_body_text(await request.body())
            return await handler(request)

        return checked
