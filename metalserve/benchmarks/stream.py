"""Timing of one streamed response: TTFT, inter-token latencies and the text, from timestamped SSE chunks.

Kept free of I/O so the maths is tested on exact timestamps.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


class StreamError(RuntimeError):
    """The server sent something that is not an OpenAI streaming chunk, or an error object."""


def chunk_text(chunk: dict[str, Any]) -> str:
    """The generated text a chunk carries: `text` (completions) or `delta.content`/reasoning (chat)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "text" in choice:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("reasoning_content") or delta.get("reasoning") or "") + (delta.get("content") or "")


@dataclass
class StreamTimer:
    """Feeds on (timestamp, chunk); TTFT is the first chunk with text, ITL the gaps between text chunks.

    Chunks without text (the chat role chunk, the usage chunk) do not count as tokens.
    """

    start: float
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""
    usage: dict[str, Any] | None = None
    last: float = 0.0
    num_text_chunks: int = 0

    def feed(self, timestamp: float, chunk: dict[str, Any]) -> None:
        if "error" in chunk:
            raise StreamError(f"server error in stream: {chunk['error']}")
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        piece = chunk_text(chunk)
        if not piece:
            return
        if self.num_text_chunks == 0:
            self.ttft = timestamp - self.start
        else:
            self.itl.append(timestamp - self.last)
        self.last = timestamp
        self.num_text_chunks += 1
        self.text += piece

    def feed_line(self, timestamp: float, line: str) -> bool:
        """Parse one SSE line; returns False on `data: [DONE]`. Comments and blank lines are skipped."""
        line = line.strip()
        if not line or line.startswith(":") or not line.startswith("data:"):
            return True
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return False
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError as exc:
            raise StreamError(f"not JSON in the stream: {data[:200]!r}") from exc
        if not isinstance(chunk, dict):
            raise StreamError(f"a stream chunk is not an object: {data[:200]!r}")
        self.feed(timestamp, chunk)
        return True

    @property
    def completion_tokens(self) -> int | None:
        """The server's count of output tokens, when it sent usage."""
        value = (self.usage or {}).get("completion_tokens")
        return int(value) if value is not None else None

    @property
    def prompt_tokens(self) -> int | None:
        value = (self.usage or {}).get("prompt_tokens")
        return int(value) if value is not None else None
