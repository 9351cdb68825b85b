"""Reasoning parsers, selected by `--reasoning-parser`."""

from __future__ import annotations

from metalserve.api.reasoning.base import ReasoningDelta, ReasoningParser, ReasoningStreamer, gate_on_reasoning
from metalserve.api.reasoning.harmony import GptOssReasoningParser
from metalserve.api.reasoning.think import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "gpt_oss": GptOssReasoningParser,
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser registered under `name`; ValueError naming the choices otherwise."""
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {sorted(REASONING_PARSERS)}") from None


__all__ = [
    "REASONING_PARSERS",
    "ReasoningDelta",
    "ReasoningParser",
    "ReasoningStreamer",
    "gate_on_reasoning",
    "get_reasoning_parser",
]
