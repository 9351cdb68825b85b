"""Tool-call parsers, selected by `--tool-call-parser`."""

from __future__ import annotations

from metalserve.api.tool_parsers.base import (
    DeltaMessage,
    ExtractedToolCalls,
    ParsedToolCall,
    Segment,
    StreamingToolParser,
    ToolCallDelta,
    ToolParser,
)
from metalserve.api.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from metalserve.api.tool_parsers.generic import GenericToolParser
from metalserve.api.tool_parsers.hermes import HermesToolParser
from metalserve.api.tool_parsers.llama3 import Llama3JsonToolParser
from metalserve.api.tool_parsers.mistral import MistralToolParser
from metalserve.api.tool_parsers.openai_harmony import HarmonyToolParser
from metalserve.api.tool_parsers.pythonic import PythonicToolParser
from metalserve.api.tool_parsers.qwen3_coder import Qwen3CoderToolParser

# Names as vLLM spells them (`openai` is its parser for gpt-oss's harmony format).
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "pythonic": PythonicToolParser,
    "deepseek_v3": DeepSeekV3ToolParser,
    "openai": HarmonyToolParser,
    "generic": GenericToolParser,  # the form of the server's own tool prompt (api/generic_tools.py)
}


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered under `name`; ValueError naming the choices otherwise."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {sorted(TOOL_PARSERS)}") from None


__all__ = [
    "TOOL_PARSERS",
    "DeltaMessage",
    "ExtractedToolCalls",
    "GenericToolParser",
    "ParsedToolCall",
    "Segment",
    "StreamingToolParser",
    "ToolCallDelta",
    "ToolParser",
    "get_tool_parser",
]
