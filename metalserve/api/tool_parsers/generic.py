"""The generic tool-call format the server itself describes to models whose chat template has no tool
support (api/generic_tools.py): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeatable,
plain text before the first call.

It is the Hermes block (the form most instruction-tuned models have seen), so its parsing is Hermes's;
this module names it and owns the markers the prompt and the parser share.
"""

from __future__ import annotations

from metalserve.api.tool_parsers.hermes import CLOSE, OPEN, HermesToolParser

CALL_OPEN, CALL_CLOSE = OPEN, CLOSE


class GenericToolParser(HermesToolParser):
    """Reads the calls of the generic tool prompt; `--tool-call-parser generic` selects it by name too."""

    name = "generic"
