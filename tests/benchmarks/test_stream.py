"""TTFT/ITL maths on exact timestamps, and the SSE parsing."""

from __future__ import annotations

import json

import pytest

from metalserve.benchmarks.stream import StreamError, StreamTimer, chunk_text


def _line(obj: object) -> str:
    return "data: " + json.dumps(obj)


def test_ttft_and_itl_from_text_chunks_only() -> None:
    t = StreamTimer(start=10.0)
    assert t.feed_line(10.1, _line({"choices": [{"delta": {"role": "assistant", "content": ""}}]}))
    assert t.feed_line(10.3, _line({"choices": [{"delta": {"content": "Hel"}}]}))
    assert t.feed_line(10.5, ": keep-alive comment")
    assert t.feed_line(10.5, _line({"choices": [{"delta": {"content": "lo"}}]}))
    assert t.feed_line(10.75, _line({"choices": [{"delta": {"content": "!"}}]}))
    assert t.feed_line(10.8, _line({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}))
    assert not t.feed_line(10.9, "data: [DONE]")
    assert t.ttft == pytest.approx(0.3)
    assert t.itl == pytest.approx([0.2, 0.25])
    assert t.text == "Hello!"
    assert (t.prompt_tokens, t.completion_tokens) == (7, 3)


def test_completions_text_and_missing_usage() -> None:
    t = StreamTimer(start=0.0)
    t.feed(1.0, {"choices": [{"index": 0, "text": "a"}]})
    t.feed(1.5, {"choices": [{"index": 0, "text": "b"}]})
    assert (t.ttft, t.itl, t.text) == (1.0, [0.5], "ab")
    assert t.completion_tokens is None and t.prompt_tokens is None


def test_reasoning_content_counts_as_text() -> None:
    assert chunk_text({"choices": [{"delta": {"reasoning_content": "think", "content": None}}]}) == "think"
    assert chunk_text({"choices": []}) == ""


def test_error_chunk_and_bad_json_raise() -> None:
    with pytest.raises(StreamError, match="boom"):
        StreamTimer(start=0.0).feed_line(0.1, _line({"error": {"message": "boom"}}))
    with pytest.raises(StreamError, match="not JSON"):
        StreamTimer(start=0.0).feed_line(0.1, "data: {oops")
    with pytest.raises(StreamError, match="not an object"):
        StreamTimer(start=0.0).feed_line(0.1, "data: [1, 2]")
