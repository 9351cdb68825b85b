"""Every error case answers in the OpenAI format with the right status; the server goes on after."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from metalserve.api.settings import ServerSettings
from tests.api.conftest import MODEL, Served, live, make_served

MSG = [{"role": "user", "content": "Hi"}]
LONG = [{"role": "user", "content": "The capital of France is Paris. " * 60}]

CASES: list[tuple[str, Any, int, str | None]] = [
    ("chat", "{not json", 400, None),
    ("chat", {"messages": "hello"}, 400, "messages"),
    ("chat", {"messages": MSG, "temperature": "hot"}, 400, "temperature"),
    ("chat", {"messages": MSG, "model": "no-such-model"}, 404, "model"),
    ("chat", {"messages": LONG}, 400, "messages"),
    ("chat", {"messages": MSG, "max_tokens": 1000}, 400, "max_tokens"),
    ("chat", {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("chat", {"messages": MSG, "n": 1000}, 400, "n"),
    ("chat", {"messages": MSG, "stream_options": {"include_usage": True}}, 400, None),
    ("chat", {"messages": []}, 400, "messages"),
    ("chat", {"messages": MSG, "tools": [], "tool_choice": "required"}, 400, "tool_choice"),
    ("chat", {"messages": MSG, "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("completions", {"prompt": [99999]}, 400, "prompt"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": "Hi", "suffix": "x"}, 400, "suffix"),
    # Fields that are not honoured are refused, never dropped silently.
    ("chat", {"messages": MSG, "no_such_field": 1}, 400, "no_such_field"),
    ("completions", {"prompt": "Hi", "store": True}, 400, "store"),
    (
        "chat",
        {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        400,
        "response_format",
    ),
    (
        "chat",
        {"messages": MSG, "stream": True, "stream_options": {"continuous_usage_stats": True}},
        400,
        "stream_options",
    ),
]


@pytest.mark.parametrize(("route", "body", "status", "param"), CASES)
def test_error_cases(server: Served, route: str, body: Any, status: int, param: str | None) -> None:
    url = f"{server.url}/v1/{'chat/completions' if route == 'chat' else 'completions'}"
    if isinstance(body, str):
        response = httpx.post(url, content=body, headers={"content-type": "application/json"})
    else:
        response = httpx.post(url, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param)
    # And the server still serves a normal request.
    ok = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": MSG})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "stop"


def test_plain_text_response_format_is_honoured(server: Served) -> None:
    body = {"model": MODEL, "messages": MSG, "response_format": {"type": "text"}}
    assert httpx.post(f"{server.url}/v1/chat/completions", json=body).status_code == 200


def test_context_messages_use_vllm_wording(server: Served) -> None:
    long = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": LONG}).json()["error"]
    assert "maximum context length is 256 tokens" in long["message"]
    big = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": MSG, "max_tokens": 1000}).json()
    assert "'max_tokens' is too large: 1000" in big["error"]["message"]


def test_error_inside_stream_is_an_event_then_done(server: Served) -> None:
    # The fake core refuses prompts holding <|endoftext|>: the failure happens after the stream began.
    ids = [0, 5, 6]
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": ids, "stream": True})
    assert response.status_code == 200
    data = [ln[6:] for ln in response.text.splitlines() if ln.startswith("data: ")]
    assert data[-1] == "[DONE]" and '"error"' in data[-2] and "refused" in data[-2]
    plain = httpx.post(f"{server.url}/v1/completions", json={"prompt": ids})
    assert plain.status_code == 400 and "refused" in plain.json()["error"]["message"]


def test_api_key_required_but_health_open() -> None:
    with live(make_served(ServerSettings(api_key="sekrit", log_stats_interval=0))) as served:
        url = f"{served.url}/v1/models"
        missing = httpx.get(url)
        assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
        assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer sekrit"}).status_code == 200
        assert httpx.get(f"{served.url}/health").status_code == 200
        assert httpx.post(f"{served.url}/tokenize", json={"prompt": "x"}).status_code == 401


def test_dead_engine_gives_503_and_unhealthy() -> None:
    with live(make_served(fail_after_steps=0)) as served:
        first = httpx.post(f"{served.url}/v1/chat/completions", json={"messages": MSG})
        assert first.status_code == 503 and first.json()["error"]["type"] == "service_unavailable"
        assert httpx.get(f"{served.url}/health").status_code == 503


def test_tokenize_errors(server: Served) -> None:
    for body in ({"messages": []}, {}, {"prompt": "x", "messages": MSG}):
        response = httpx.post(f"{server.url}/tokenize", json=body)
        assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": [10**9]}).status_code == 400
