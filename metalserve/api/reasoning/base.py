"""Reasoning parsers: split a model's output into its reasoning section and the answer, while it streams."""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from metalserve.sampling_params import SamplingParams


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningStreamer(ABC):
    """One choice's output, fed as text deltas; what may still be part of a marker is held back."""

    @abstractmethod
    def feed(self, delta: str) -> ReasoningDelta: ...

    @abstractmethod
    def finish(self) -> ReasoningDelta: ...


class ReasoningParser(ABC):
    """A model family's reasoning format; `prompt_tail` is the end of the rendered prompt as text
    (templates that open the reasoning section themselves put its start marker there)."""

    name: str = ""
    # The marker after which the answer starts: a grammar for the answer begins once these tokens are out.
    end_marker: str = ""
    # Markers are special tokens in some formats: the text must keep them to be split.
    keeps_special_tokens: bool = False

    @abstractmethod
    def streaming(self, prompt_tail: str) -> ReasoningStreamer: ...

    def split(self, text: str, prompt_tail: str = "") -> ReasoningDelta:
        """A whole output at once: the same state machine as streaming, fed in one piece."""
        streamer = self.streaming(prompt_tail)
        first, rest = streamer.feed(text), streamer.finish()
        return ReasoningDelta(first.reasoning + rest.reasoning, first.content + rest.content)


def partial_tail(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `marker` (it may still complete)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def gate_on_reasoning(params: SamplingParams, parser: ReasoningParser | None, tokenizer: Any) -> None:
    """With a reasoning parser, a grammar starts only after the reasoning's end marker is in the output."""
    spec = params.structured_outputs
    if parser is None or spec is None or not parser.end_marker:
        return
    ids = tuple(int(t) for t in tokenizer.encode(parser.end_marker, add_special_tokens=False))
    params.structured_outputs = dataclasses.replace(spec, reasoning_end_token_ids=ids)
