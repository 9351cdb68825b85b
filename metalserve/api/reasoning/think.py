"""`<think>...</think>` reasoning: Qwen3 (optional section) and DeepSeek-R1 (always opens with reasoning)."""

from __future__ import annotations

from metalserve.api.reasoning.base import ReasoningDelta, ReasoningParser, ReasoningStreamer, partial_tail

START, END = "<think>", "</think>"


class ThinkStreamer(ReasoningStreamer):
    """States: `undecided` (does the output open with <think>?), `reasoning` until </think>, `content`."""

    def __init__(self, in_reasoning: bool) -> None:
        # In reasoning from the start, a leading <think> the model writes anyway is still dropped.
        self.state = "reasoning" if in_reasoning else "undecided"
        self._at_start = True
        self._strip_content = False
        self._buffer = ""

    def feed(self, delta: str) -> ReasoningDelta:
        self._buffer += delta
        out = ReasoningDelta()
        while self._step(out):
            pass
        return out

    def _step(self, out: ReasoningDelta) -> bool:
        """Consume what can be decided; True when another pass may make progress."""
        if self._at_start:
            head = self._buffer.lstrip()
            if head and START.startswith(head) and head != START:
                return False  # maybe the start marker, not complete yet
            self._at_start = not head
            if head.startswith(START):
                self._buffer, self.state = head[len(START) :], "reasoning"
                return True
            if head and self.state == "undecided":
                self.state = "content"
            if not head:
                return False
        if self.state == "reasoning":
            end = self._buffer.find(END)
            if end < 0:
                keep = partial_tail(self._buffer, END)
                out.reasoning += self._buffer[: len(self._buffer) - keep]
                self._buffer = self._buffer[len(self._buffer) - keep :]
                return False
            out.reasoning += self._buffer[:end]
            self._buffer, self.state, self._strip_content = self._buffer[end + len(END) :], "content", True
            return bool(self._buffer)
        if self._strip_content:
            self._buffer = self._buffer.lstrip()
            self._strip_content = not self._buffer
        out.content += self._buffer
        self._buffer = ""
        return False

    def finish(self) -> ReasoningDelta:
        rest, self._buffer = self._buffer, ""
        if self.state == "reasoning":
            return ReasoningDelta(reasoning=rest)
        return ReasoningDelta(content=rest.lstrip() if self._strip_content else rest)


class Qwen3ReasoningParser(ReasoningParser):
    """Reasoning only when the output (or the prompt's end) opens a <think> section."""

    name = "qwen3"
    end_marker = END

    def streaming(self, prompt_tail: str) -> ReasoningStreamer:
        return ThinkStreamer(in_reasoning=prompt_tail.rstrip().endswith(START))


class DeepSeekR1ReasoningParser(ReasoningParser):
    """R1 always reasons first (its template opens <think>); without </think> everything is reasoning."""

    name = "deepseek_r1"
    end_marker = END

    def streaming(self, prompt_tail: str) -> ReasoningStreamer:
        return ThinkStreamer(in_reasoning=True)
