"""The value of a JSON text cut short (a tool call's arguments cut by max_tokens), as far as it goes.

Anthropic returns a tool_use block cut by max_tokens with the input written so far; its `input` must be
an object, so the open string, arrays and objects are closed, and a dangling key or value is dropped.
"""

from __future__ import annotations

import json
from typing import Any

_CLOSERS = {"{": "}", "[": "]"}


def complete_partial_json(text: str) -> Any | None:
    """The value `text` starts to spell, closed where it was cut; None when no prefix of it is JSON."""
    stack: list[str] = []
    in_string = escaped = False
    clean: list[tuple[int, str]] = []  # (cut here, closers then): points where dropping the rest is valid
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in _CLOSERS:
            stack.append(_CLOSERS[ch])
            clean.append((i + 1, "".join(reversed(stack))))
        elif ch in "}]":
            if stack:
                stack.pop()
        elif ch == ",":
            clean.append((i, "".join(reversed(stack))))
    tail = text
    if in_string:
        tail = (tail[:-1] if escaped else tail) + '"'
    candidates = [tail + "".join(reversed(stack))] + [text[:cut] + closers for cut, closers in reversed(clean)]
    for candidate in candidates[:8]:
        try:
            return json.loads(candidate)
        except ValueError:
            continue
    return None
