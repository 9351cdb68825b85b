"""The HTTP API over a fake core, through a real uvicorn server: httpx and the official openai SDK."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai

from tests.api.conftest import MODEL, Served
from tests.api.fakes import DEFAULT_REPLY


def _chat(server: Served, **body: Any) -> httpx.Response:
    body.setdefault("messages", [{"role": "user", "content": "Hi"}])
    return httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, **body}, timeout=30)


def _events(response: httpx.Response) -> list[Any]:
    lines = [ln[len("data: ") :] for ln in response.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def _stream_chat(server: Served, **body: Any) -> list[Any]:
    return _events(_chat(server, stream=True, **body))


def test_models_health_version(server: Served) -> None:
    models = httpx.get(f"{server.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL] and models["data"][0]["max_model_len"] == 256
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_chat_non_streamed(server: Served) -> None:
    body = _chat(server).json()
    assert body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": DEFAULT_REPLY}
    assert choice["finish_reason"] == "stop"
    count = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    usage = body["usage"]
    assert usage["prompt_tokens"] == count["count"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert "cached_tokens" in usage["prompt_tokens_details"]


def test_streamed_equals_non_streamed_with_usage_chunk(server: Served) -> None:
    events = _stream_chat(server, temperature=0, stream_options={"include_usage": True})
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text == _chat(server, temperature=0).json()["choices"][0]["message"]["content"]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] > 0
    assert all(e["usage"] is None for e in events[:-1])
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "stop"


def test_max_tokens_and_max_completion_tokens(server: Served) -> None:
    for key in ("max_tokens", "max_completion_tokens"):
        body = _chat(server, **{key: 3}).json()
        assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 3


def test_stop_strings_streamed_and_not(server: Served) -> None:
    msgs = [{"role": "user", "content": "say:One two STOP three four"}]
    whole = _chat(server, messages=msgs, stop=["STOP"]).json()["choices"][0]
    assert whole["message"]["content"] == "One two " and whole["finish_reason"] == "stop"
    assert whole["stop_reason"] == "STOP"
    events = _stream_chat(server, messages=msgs, stop="STOP")
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == "One two "


def test_n_with_seed_differs_and_repeats(server: Served) -> None:
    first = _chat(server, n=2, seed=7, temperature=1).json()
    texts = [c["message"]["content"] for c in first["choices"]]
    assert [c["index"] for c in first["choices"]] == [0, 1] and texts[0] != texts[1]
    again = _chat(server, n=2, seed=7, temperature=1).json()
    assert [c["message"]["content"] for c in again["choices"]] == texts
    events = _stream_chat(server, n=2, seed=7)
    for i in (0, 1):
        got = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"][0]["index"] == i)
        assert got == texts[i]


def test_logprobs_shapes(server: Served) -> None:
    choice = _chat(server, logprobs=True, top_logprobs=3, max_tokens=4).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == 4 and all(len(c["top_logprobs"]) == 3 for c in content)
    assert all(isinstance(c["bytes"], list) and c["logprob"] <= 0 for c in content)
    comp = httpx.post(f"{server.url}/v1/completions", json={"prompt": "The", "max_tokens": 3, "logprobs": 2}).json()[
        "choices"
    ][0]["logprobs"]
    assert len(comp["tokens"]) == 3 == len(comp["token_logprobs"]) == len(comp["text_offset"])
    assert all(len(t) <= 2 for t in comp["top_logprobs"])


def test_return_tokens_as_token_ids_names_every_token_by_its_id(server: Served) -> None:
    """vLLM's field: byte tokens that are no whole character all decode to U+FFFD, ids tell them apart."""
    ids = _chat(server, logprobs=True, top_logprobs=2, max_tokens=4, return_tokens_as_token_ids=True).json()
    content = ids["choices"][0]["logprobs"]["content"]
    plain = _chat(server, logprobs=True, max_tokens=4).json()["choices"][0]["logprobs"]["content"]
    tok = server.engine.tokenizer
    assert [tok.decode([int(c["token"].removeprefix("token_id:"))]) for c in content] == [c["token"] for c in plain]
    assert all(t["token"].startswith("token_id:") for c in content for t in c["top_logprobs"])
    body = {"prompt": "The", "max_tokens": 3, "logprobs": 1, "return_tokens_as_token_ids": True, "stream": True}
    streamed = _events(httpx.post(f"{server.url}/v1/completions", json=body, timeout=30))
    pieces = [e["choices"][0]["logprobs"] for e in streamed if e["choices"] and e["choices"][0]["logprobs"]]
    tokens = [t for piece in pieces for t in piece["tokens"]]
    assert len(tokens) == 3 and all(t.startswith("token_id:") and t[9:].isdigit() for t in tokens)


def test_cached_tokens_and_cache_salt(server: Served) -> None:
    msgs = [{"role": "user", "content": "The capital of France is Paris. " * 3}]
    _chat(server, messages=msgs, max_tokens=1)
    again = _chat(server, messages=msgs, max_tokens=1).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert again > 0
    salted = [
        _chat(server, messages=msgs, max_tokens=1, cache_salt=salt).json()["usage"]["prompt_tokens_details"]
        for salt in ("alice", "bob")
    ]
    assert [s["cached_tokens"] for s in salted] == [0, 0]


def test_completions_forms(server: Served) -> None:
    url = f"{server.url}/v1/completions"
    body = httpx.post(url, json={"model": MODEL, "prompt": "say:abc", "max_tokens": 50}).json()
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "abc"
    batch = httpx.post(url, json={"prompt": ["say:x", "say:y"], "n": 2, "max_tokens": 50}).json()
    assert [c["text"] for c in batch["choices"]] == ["x", "x", "y", "y"]
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "say:z"}).json()["tokens"]
    assert httpx.post(url, json={"prompt": ids}).json()["choices"][0]["text"] == "z"
    echo = httpx.post(url, json={"prompt": "say:q", "echo": True}).json()["choices"][0]["text"]
    assert echo == "say:qq"
    streamed = _events(httpx.post(url, json={"prompt": "say:hello there", "stream": True}))
    assert "".join(e["choices"][0]["text"] for e in streamed) == "hello there"


def test_tokenize_detokenize_roundtrip(server: Served) -> None:
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "caf\u00e9 \U0001f600"}).json()["tokens"]
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": tokens}).json()["prompt"] == "caf\u00e9 \U0001f600"


def test_tokenize_messages_counts_the_chat_prompt_with_its_tools(server: Served) -> None:
    """/tokenize renders messages as the chat request would, tools included (they were once dropped)."""
    messages = [{"role": "user", "content": "Hi"}]
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]
    bare = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["count"]
    counted = httpx.post(f"{server.url}/tokenize", json={"messages": messages, "tools": tools}).json()["count"]
    body = {"model": MODEL, "messages": messages, "tools": tools, "max_tokens": 1}
    chat = httpx.post(f"{server.url}/v1/chat/completions", json=body).json()
    assert counted == chat["usage"]["prompt_tokens"] and counted > bare
    refused = httpx.post(f"{server.url}/tokenize", json={"messages": messages, "documents": []})
    assert refused.status_code == 400 and "documents" in refused.text


def test_metrics_have_vllm_names(server: Served) -> None:
    _chat(server, max_tokens=2)
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_count",
    ):
        assert name in text
    gen = [ln for ln in text.splitlines() if ln.startswith("vllm:generation_tokens_total")]
    assert gen and float(gen[0].split()[-1]) >= 2


def test_openai_sdk(server: Served) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    assert chat.choices[0].message.content == DEFAULT_REPLY
    pieces = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True, stream_options={"include_usage": True}
    )
    chunks = list(pieces)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == DEFAULT_REPLY
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens_details is not None
    comp = client.completions.create(model=MODEL, prompt="say:ok", max_tokens=10)
    assert comp.choices[0].text == "ok"
