"""The bench client's `/tokenize` counter speaks vLLM's / metalserve's body and llama.cpp's."""

from __future__ import annotations

import json

import httpx

from metalserve.benchmarks.tokenizer import ServerTokenizer


def _llama_server(request: httpx.Request) -> httpx.Response:
    """A newer llama-server: `prompt` is not its field, so it answers 200 with no tokens; `content` works."""
    body = json.loads(request.content)
    text = body.get("content", "")
    return httpx.Response(200, json={"tokens": [len(word) for word in text.split()]})


def _vllm_shape(request: httpx.Request) -> httpx.Response:
    body = json.loads(request.content)
    assert "prompt" in body, body
    return httpx.Response(200, json={"tokens": [7] * len(body["prompt"].split()), "count": 0})


def test_a_llama_server_that_ignores_prompt_is_asked_with_content() -> None:
    tok = ServerTokenizer("http://peer", None, transport=httpx.MockTransport(_llama_server))
    assert tok.encode("one three") == [3, 5]
    assert tok.encode("") == []


def test_the_prompt_field_is_used_where_the_server_reads_it() -> None:
    tok = ServerTokenizer("http://ours", "m", transport=httpx.MockTransport(_vllm_shape))
    assert tok.encode("a b c") == [7, 7, 7]
