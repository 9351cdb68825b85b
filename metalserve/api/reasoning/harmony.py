"""gpt-oss (harmony): the `analysis` channel is reasoning, the `final` channel the answer.

`<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>`.
Other channels (commentary, where tool calls live) pass through as raw text for a tool parser.
"""

from __future__ import annotations

from metalserve.api.reasoning.base import ReasoningDelta, ReasoningParser, ReasoningStreamer, partial_tail

MESSAGE, CHANNEL = "<|message|>", "<|channel|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")


class HarmonyStreamer(ReasoningStreamer):
    """Alternates between a message header (up to <|message|>) and its body (up to an end marker)."""

    def __init__(self) -> None:
        self._buffer = ""
        self._header: str | None = ""  # None: inside a body
        self._channel = ""
        self._plain = False  # the output is not harmony at all: everything is the answer

    def feed(self, delta: str) -> ReasoningDelta:
        self._buffer += delta
        out = ReasoningDelta()
        while self._step(out):
            pass
        return out

    def _step(self, out: ReasoningDelta) -> bool:
        if self._plain:
            out.content, self._buffer = out.content + self._buffer, ""
            return False
        if self._header is not None:
            head = self._buffer.lstrip()
            if head and not head.startswith("<|") and not "<|".startswith(head):
                self._plain = True
                return True
            at = self._buffer.find(MESSAGE)
            if at < 0:
                return False
            header = self._buffer[:at]
            self._channel = header.split(CHANNEL, 1)[1].strip() if CHANNEL in header else ""
            self._header, self._buffer = None, self._buffer[at + len(MESSAGE) :]
            if not self._is_answer_channel():
                out.content += header + MESSAGE
            return True
        ends = [(self._buffer.find(e), e) for e in ENDS if e in self._buffer]
        if not ends:
            keep = max(partial_tail(self._buffer, e) for e in ENDS)
            self._emit(self._buffer[: len(self._buffer) - keep], out)
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return False
        at, end = min(ends)
        self._emit(self._buffer[:at], out, end)
        self._buffer, self._header = self._buffer[at + len(end) :], ""
        return True

    def _is_answer_channel(self) -> bool:
        return self._channel in ("analysis", "final")

    def _emit(self, text: str, out: ReasoningDelta, end: str = "") -> None:
        if self._channel == "analysis":
            out.reasoning += text
        elif self._channel == "final":
            out.content += text
        else:
            out.content += text + end

    def finish(self) -> ReasoningDelta:
        out = ReasoningDelta()
        rest, self._buffer = self._buffer, ""
        if self._plain:
            out.content = rest
        elif self._header is None:
            self._emit(rest, out)
        elif rest.strip():
            out.content = rest  # a header that never reached <|message|>
        return out


class GptOssReasoningParser(ReasoningParser):
    name = "gpt_oss"
    end_marker = "<|channel|>final<|message|>"
    keeps_special_tokens = True

    def streaming(self, prompt_tail: str) -> ReasoningStreamer:
        return HarmonyStreamer()
