"""The real server on the default model, driven by the official `openai` SDK and by httpx."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.e2e.server import RunningServer, running_server

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with running_server("--max-model-len", "1024", "--kv-cache-memory", str(96 << 20)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", timeout=300)


def test_chat_answers_paris(client: openai.OpenAI, server: RunningServer) -> None:
    r = client.chat.completions.create(model=server.model, messages=QUESTION, max_tokens=16, temperature=0)
    assert "Paris" in (r.choices[0].message.content or "")
    assert r.choices[0].finish_reason == "stop"
    assert r.usage is not None and r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0


def test_streamed_chat_equals_non_streamed_at_temperature_zero(client: openai.OpenAI, server: RunningServer) -> None:
    kwargs = dict(model=server.model, messages=QUESTION, max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content  # type: ignore[call-overload]
    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)  # type: ignore[call-overload]
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens > 0


def test_streamed_completion_equals_non_streamed(client: openai.OpenAI, server: RunningServer) -> None:
    kwargs = dict(model=server.model, prompt="The quick brown fox", max_tokens=10, temperature=0)
    whole = client.completions.create(**kwargs).choices[0].text  # type: ignore[call-overload]
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)  # type: ignore[call-overload]
    assert streamed == whole and whole


def test_n_two_with_a_seed_is_reproducible(client: openai.OpenAI, server: RunningServer) -> None:
    kwargs = dict(model=server.model, prompt="Once upon a time", max_tokens=12, temperature=1.0, n=2, seed=1234)
    a = [c.text for c in client.completions.create(**kwargs).choices]  # type: ignore[call-overload]
    b = [c.text for c in client.completions.create(**kwargs).choices]  # type: ignore[call-overload]
    assert len(a) == 2 and a == b


def test_logprobs_have_the_requested_shape(client: openai.OpenAI, server: RunningServer) -> None:
    r = client.chat.completions.create(
        model=server.model, messages=QUESTION, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == r.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0.0
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob


def test_a_stop_string_ends_the_text_before_it(client: openai.OpenAI, server: RunningServer) -> None:
    r = client.chat.completions.create(model=server.model, messages=QUESTION, max_tokens=16, temperature=0, stop=["is"])
    assert r.choices[0].message.content == "The capital of France "
    assert r.choices[0].finish_reason == "stop"


def test_a_repeated_prompt_reports_cached_tokens(client: openai.OpenAI, server: RunningServer) -> None:
    prompt = "Tell me a story about a lighthouse keeper. " * 6
    kwargs = dict(model=server.model, prompt=prompt, max_tokens=2, temperature=0)
    client.completions.create(**kwargs)  # type: ignore[call-overload]
    again = client.completions.create(**kwargs)  # type: ignore[call-overload]
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # type: ignore[union-attr]


def test_different_cache_salts_never_share_cached_tokens(server: RunningServer) -> None:
    body = {"model": server.model, "prompt": "A salted prompt about tenants and isolation. " * 6, "max_tokens": 2}
    url = f"{server.v1}/completions"
    first = httpx.post(url, json={**body, "cache_salt": "tenant-a"}, timeout=300).json()
    other = httpx.post(url, json={**body, "cache_salt": "tenant-b"}, timeout=300).json()
    same = httpx.post(url, json={**body, "cache_salt": "tenant-a"}, timeout=300).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert same["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def wait_until_idle(server: RunningServer, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while server.metric("vllm:num_requests_running") or server.metric("vllm:kv_cache_usage_perc"):
        assert time.monotonic() < deadline, "the server did not free the request's blocks"
        time.sleep(0.2)


def test_a_client_that_disconnects_mid_stream_is_aborted_and_freed(server: RunningServer) -> None:
    body = {
        "model": server.model,
        "prompt": "Count to one thousand:",
        "max_tokens": 500,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{server.v1}/completions", json=body, timeout=300) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        first = json.loads(next(lines)[len("data: ") :])
        assert first["choices"][0]["text"] is not None
        assert server.metric("vllm:num_requests_running") == 1
    wait_until_idle(server)
    # And the server goes on serving.
    ok = httpx.post(f"{server.v1}/completions", json={**body, "stream": False, "max_tokens": 3}, timeout=300)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"messages": []}, 400),
        ({"messages": QUESTION, "max_tokens": 5000}, 400),
        ({"messages": [{"role": "user", "content": "hi " * 1100}]}, 400),
        ({"messages": QUESTION, "top_logprobs": 50, "logprobs": True}, 400),
        ({"messages": QUESTION, "stream_options": {"include_usage": True}}, 400),
        ({"messages": QUESTION, "model": "no-such-model"}, 404),
        ({"messages": QUESTION, "temperature": "hot"}, 400),
    ],
)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(
    server: RunningServer, body: dict[str, object], status: int
) -> None:
    r = httpx.post(f"{server.v1}/chat/completions", json={"model": server.model, **body}, timeout=60)
    assert r.status_code == status
    error = r.json()["error"]
    assert error["message"] and error["type"]
    ok = httpx.post(
        f"{server.v1}/chat/completions",
        json={"model": server.model, "messages": QUESTION, "max_tokens": 2},
        timeout=300,
    )
    assert ok.status_code == 200
