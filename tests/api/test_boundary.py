"""Input checks at the HTTP boundary: text that cannot be encoded, numeric ranges, sizes, CORS, HEAD."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

from metalserve.api.settings import ServerSettings
from metalserve.api.text_guard import first_unencodable
from tests.api.conftest import MODEL, Served, live, make_served

MSG = [{"role": "user", "content": "Hi"}]


def _post(server: Served, path: str, raw: str) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", content=raw, headers={"content-type": "application/json"}, timeout=30)


def test_first_unencodable_names_the_path() -> None:
    assert first_unencodable({"a": [{"b": "ok"}, {"c": "x\ud800"}]}) == "a.1.c"
    assert first_unencodable({"a": {"\udfff": 1}}) == "a"
    assert first_unencodable(["fine", {"k": "\U0001f600"}]) is None
    assert first_unencodable("\ud83d") == "body"


# A lone surrogate as JSON spells it, in every kind of field; the 400 names the field.
SURROGATE_CASES = [
    ("/v1/completions", '{"prompt": "Hi", "max_tokens": 2, "cache_salt": "\\ud800"}', "cache_salt"),
    ("/v1/completions", '{"prompt": "\\ud800", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "bad \\udc00"], "max_tokens": 2}', "prompt.1"),
    ("/v1/completions", '{"model": "\\ud800", "prompt": "Hi"}', "model"),
    ("/v1/completions", '{"prompt": "Hi", "stop": ["\\udbff"]}', "stop.0"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages.0.content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "Hi", "name": "\\ud800"}]}', "messages.0.name"),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function", "function": '
        '{"name": "f", "parameters": {"type": "object", "properties": {"\\ud800": {}}}}}]}',
        "tools.0.function.parameters.properties",
    ),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
    ("/detokenize", '{"model": "\\udc80", "tokens": [1]}', "model"),
]


@pytest.mark.parametrize(("path", "raw", "param"), SURROGATE_CASES)
def test_lone_surrogates_are_a_400_naming_the_field(server: Served, path: str, raw: str, param: str) -> None:
    response = _post(server, path, raw)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "surrogate" in error["message"]
    # The engine is untouched and serving; a valid surrogate pair (an emoji) is fine.
    ok = _post(server, "/v1/completions", '{"prompt": "say:\\ud83d\\ude00", "cache_salt": "\\ud83d\\ude00"}')
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "\U0001f600"
    assert httpx.get(f"{server.url}/health").status_code == 200


NON_FINITE_CASES = [  # Python's JSON reader takes these; JSON has no such numbers
    ("/v1/completions", '{"prompt": "Hi", "temperature": NaN}', "temperature"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "Hi"}], "top_p": -Infinity}', "top_p"),
    (
        "/v1/responses",  # found by the fuzz test: the answer echoes the tools, and could not be written (a 500)
        '{"input": [{"role": "user", "content": "Hi"}], "max_output_tokens": 3, '
        '"tools": [{"type": "function", "name": "f", "parameters": {"type": Infinity}}]}',
        "tools.0.parameters.type",
    ),
    ("/v1/messages", '{"max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}], "top_k": NaN}', "top_k"),
]


@pytest.mark.parametrize(("path", "raw", "param"), NON_FINITE_CASES)
def test_nan_and_infinity_are_a_400_naming_the_field(server: Served, path: str, raw: str, param: str) -> None:
    response = _post(server, path, raw)
    assert response.status_code == 400, response.text
    assert param in response.text and "NaN and Infinity are not JSON numbers" in response.text
    spelled = _post(server, "/v1/completions", '{"prompt": "say:NaN Infinity", "max_tokens": 30}')  # as text: fine
    assert spelled.status_code == 200 and spelled.json()["choices"][0]["text"] == "NaN Infinity"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": MSG, "min_tokens": 5, "max_tokens": 2}, None),
        ({"messages": MSG, "seed": 2**64}, "seed"),
        ({"messages": MSG, "seed": -(2**63) - 1}, "seed"),
        ({"messages": MSG, "cache_salt": ""}, "cache_salt"),
        ({"messages": MSG, "priority": 2**63}, "priority"),
    ],
)
def test_numeric_and_empty_fields_vllm_refuses(server: Served, body: dict[str, Any], param: str | None) -> None:
    response = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, **body}, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert "min_tokens" in response.json()["error"]["message"] or param is not None


def test_prompts_times_n_is_capped(server: Served) -> None:
    body = {"prompt": ["Hi"] * 9, "n": 16, "max_tokens": 1}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400 and "144 sequences" in response.json()["error"]["message"]
    assert httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": ["Hi"] * 8}).status_code == 200


def test_health_answers_while_a_10_mb_prompt_is_refused(server: Served) -> None:
    big = {"messages": [{"role": "user", "content": "word " * 2_000_000}], "max_tokens": 1}
    result: dict[str, httpx.Response] = {}
    sender = threading.Thread(
        target=lambda: result.update(r=httpx.post(f"{server.url}/v1/chat/completions", json=big, timeout=60))
    )
    sender.start()
    latencies = []
    while sender.is_alive():
        start = time.monotonic()
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        latencies.append(time.monotonic() - start)
        time.sleep(0.01)
    sender.join()
    error = result["r"].json()["error"]
    assert result["r"].status_code == 400 and error["code"] == "context_length_exceeded", error
    assert "at least" in error["message"]  # refused from its length, before any tokenizing
    assert latencies and max(latencies) < 1.0, latencies


def test_body_over_the_limit_is_a_413_in_the_openai_shape() -> None:
    settings = ServerSettings(max_request_body_bytes=4096, log_stats_interval=0)
    with live(make_served(settings)) as served:
        body = {"messages": [{"role": "user", "content": "x" * 5000}]}
        response = httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 413, response.text
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        ok = httpx.post(f"{served.url}/v1/chat/completions", json={"messages": MSG}, timeout=30)
        assert ok.status_code == 200


def test_head_health_and_cors_preflight_without_the_key() -> None:
    settings = ServerSettings(api_key="k", allowed_origins=("http://app.example",), log_stats_interval=0)
    with live(make_served(settings)) as served:
        assert httpx.head(f"{served.url}/health").status_code == 200
        preflight = httpx.options(
            f"{served.url}/v1/chat/completions",
            headers={"Origin": "http://app.example", "Access-Control-Request-Method": "POST"},
        )
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "http://app.example"
        other = httpx.options(
            f"{served.url}/v1/chat/completions",
            headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
        )
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        assert httpx.post(f"{served.url}/v1/chat/completions", json={"messages": MSG}).status_code == 401


def test_chunked_body_over_the_limit_is_a_413_too() -> None:
    settings = ServerSettings(max_request_body_bytes=4096, log_stats_interval=0)

    def chunks() -> Any:
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}]}'

    with live(make_served(settings)) as served:
        response = httpx.post(
            f"{served.url}/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"}
        )
        assert response.status_code == 413 and "4096 bytes" in response.json()["error"]["message"]


def test_agent_apis_refuse_lone_surrogates_in_their_own_error_shapes(server: Served) -> None:
    messages = '{"model": "tiny-model", "max_tokens": 4, "messages": [{"role": "user", "content": "\\ud800"}]}'
    response = _post(server, "/v1/messages", messages)
    body = response.json()
    assert response.status_code == 400 and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error" and "messages.0.content" in body["error"]["message"]
    responses = '{"model": "tiny-model", "input": "\\udc00"}'
    response = _post(server, "/v1/responses", responses)
    assert response.status_code == 400 and response.json()["error"]["param"] == "input"
