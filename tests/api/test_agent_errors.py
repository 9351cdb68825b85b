"""What coding agents recover from: Anthropic's wording of the context errors, retry advice headers,
the model card routes, the image refusal, and the Responses API's own field names (fake core, real
uvicorn server, the official SDKs where they parse)."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import anthropic
import httpx
import openai
import pytest

from metalserve.api.errors import retry_headers
from metalserve.api.settings import ServerSettings
from tests.api.conftest import MODEL, Served, live, make_served

HI = [{"role": "user", "content": "Hi"}]
# Longer than the fake core's 256-token context.
LONG = [{"role": "user", "content": "The capital of France is Paris. " * 60}]
# Claude Code's own patterns for the two context errors (it retries with a smaller max_tokens on the
# first and offers compaction on the second).
OVERFLOW = re.compile(r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+), decrease input")
TOO_LONG = re.compile(r"prompt is too long: (\d+) tokens > (\d+) maximum")


def _messages(server: Served, path: str = "/v1/messages", **body: Any) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, headers={"anthropic-version": "2023-06-01"})


def test_anthropic_context_errors_in_claude_codes_words(server: Served) -> None:
    over = _messages(server, max_tokens=32000, messages=HI)
    assert over.status_code == 400 and over.headers["x-should-retry"] == "false"
    error = over.json()["error"]
    assert error["type"] == "invalid_request_error"
    match = OVERFLOW.search(error["message"])
    assert match is not None, error["message"]
    prompt, asked, limit = (int(g) for g in match.groups())
    assert (asked, limit) == (32000, 256) and 0 < prompt < 256
    # The retry Claude Code makes from those numbers fits.
    assert _messages(server, max_tokens=limit - prompt, messages=HI).status_code == 200

    long = _messages(server, max_tokens=8, messages=LONG).json()["error"]
    match = TOO_LONG.search(long["message"])
    assert match is not None and int(match.group(2)) == 256 and int(match.group(1)) > 256, long
    counted = _messages(server, "/v1/messages/count_tokens", messages=LONG * 40)
    assert counted.status_code == 400 and TOO_LONG.search(counted.json()["error"]["message"])
    # The chat API keeps vLLM's wording for the same situation.
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": HI, "max_tokens": 32000}).json()
    assert "'max_tokens' is too large: 32000" in chat["error"]["message"]


def test_anthropic_sdk_reads_the_context_error(server: Served) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60)
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=MODEL, max_tokens=20000, messages=HI)  # type: ignore[arg-type]
    assert OVERFLOW.search(str(info.value))


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/v1/chat/completions", {"messages": HI, "max_tokens": 10**6}, 400),
        ("/v1/chat/completions", {"messages": HI, "model": "nope"}, 404),
        ("/v1/messages", {"messages": HI, "max_tokens": 10**6, "model": MODEL}, 400),
        ("/v1/responses", {"input": "Hi", "max_output_tokens": 10**6}, 400),
        ("/v1/responses", {"input": "Hi", "nope": 1}, 400),
    ],
)
def test_non_retryable_errors_say_so(server: Served, path: str, body: dict[str, Any], status: int) -> None:
    response = httpx.post(f"{server.url}{path}", json=body)
    assert response.status_code == status and response.headers["x-should-retry"] == "false"
    assert "retry-after" not in response.headers


def test_wrong_key_fails_at_once_in_every_api() -> None:
    settings = ServerSettings(api_key="right", log_stats_interval=0, max_request_body_bytes=1024)
    with live(make_served(settings)) as served:
        for path in ("/v1/messages", "/v1/chat/completions", "/v1/responses"):
            response = httpx.post(f"{served.url}{path}", json={}, headers={"x-api-key": "wrong"})
            assert response.status_code == 401 and response.headers["x-should-retry"] == "false"
        claude = anthropic.Anthropic(base_url=served.url, api_key="wrong")  # default retries: 2
        with pytest.raises(anthropic.AuthenticationError):
            claude.messages.create(model=MODEL, max_tokens=4, messages=HI)  # type: ignore[arg-type]
        big = httpx.post(f"{served.url}/v1/chat/completions", content=b"x" * 2000, headers={"x-api-key": "right"})
        assert big.status_code == 413 and big.headers["x-should-retry"] == "false"


def test_retry_advice_by_status() -> None:
    assert retry_headers(429) == {"retry-after": "1"} and retry_headers(503) == {"retry-after": "5"}
    assert all(retry_headers(s) == {"x-should-retry": "false"} for s in (400, 401, 403, 404, 413, 422))
    assert retry_headers(500) == {} and retry_headers(408) == {}


def test_draining_server_asks_for_a_retry_later() -> None:
    served = make_served()
    with live(served):
        served.engine.draining = True
        try:
            for path in ("/v1/messages", "/v1/chat/completions", "/v1/responses"):
                body = {"model": MODEL, "messages": HI, "max_tokens": 4, "input": "Hi"}
                if path != "/v1/responses":
                    body.pop("input")
                else:
                    body = {"input": "Hi"}
                response = httpx.post(f"{served.url}{path}", json=body)
                assert response.status_code == 503 and response.headers["retry-after"] == "5", path
        finally:
            served.engine.draining = False


def test_every_4xx_is_logged_with_its_reason(server: Served, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="metalserve.api.errors"):
        httpx.post(f"{server.url}/v1/chat/completions", json={"messages": HI, "temperature": "hot"})
        httpx.get(f"{server.url}/v1/models/nope")
    lines = [r.getMessage() for r in caplog.records if r.name == "metalserve.api.errors"]
    assert any(line.startswith("400 on /v1/chat/completions: temperature") for line in lines), lines
    assert any(line.startswith("404 on /v1/models/nope") for line in lines), lines


def test_model_routes_in_both_shapes(server: Served) -> None:
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    card = oai.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model" and card.owned_by == "metalserve"
    assert [m.id for m in oai.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("nope")

    claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    info = claude.models.retrieve(MODEL)
    assert info.type == "model" and info.id == MODEL and info.display_name == MODEL
    assert info.max_input_tokens == 256 and info.max_tokens == 255 and info.lifecycle == "active"
    assert [m.id for m in claude.models.list()] == [MODEL]
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.models.retrieve("nope")
    assert missing.value.response.json()["error"]["type"] == "not_found_error"
    raw = httpx.get(f"{server.url}/v1/models/{MODEL}", headers={"anthropic-version": "2023-06-01"}).text
    anthropic.types.ModelInfo.model_validate_json(raw, strict=True)
    listed = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    openai.types.Model.model_validate_json(json.dumps(listed), strict=True)


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}


def test_image_refusal_is_one_claude_code_drops(server: Served) -> None:
    """A text-only model refuses images (api/images.py, issue 30's) in words Claude Code drops them on."""
    turns = [{"role": "user", "content": [{"type": "text", "text": "look"}, IMAGE]}]
    error = _messages(server, max_tokens=4, messages=turns).json()["error"]
    assert "could not process image" in error["message"]
    # An image inside a tool result (Claude Code's Read of a picture).
    use = {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [IMAGE]}
    nested = [*HI, {"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}]
    error = _messages(server, max_tokens=4, messages=nested).json()["error"]
    assert "could not process image" in error["message"]
    part = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}
    responses = httpx.post(f"{server.url}/v1/responses", json={"input": [{"role": "user", "content": [part]}]})
    assert responses.status_code == 400 and "could not process image" in responses.json()["error"]["message"]


def test_responses_errors_name_responses_fields(server: Served) -> None:
    long = httpx.post(f"{server.url}/v1/responses", json={"input": LONG[0]["content"]}).json()["error"]
    assert long["param"] == "input" and long["code"] == "context_length_exceeded"
    big = httpx.post(f"{server.url}/v1/responses", json={"input": "Hi", "max_output_tokens": 1000}).json()["error"]
    assert big["param"] == "max_output_tokens" and "'max_output_tokens' is too large: 1000" in big["message"]


def test_slow_prefill_stream_starts_and_pings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Claude Code drops a stream idle for 5 minutes: a long prefill must still send events (more in
    test_stream_keepalive.py)."""
    monkeypatch.setattr("metalserve.api.keepalive.KEEPALIVE_SECONDS", 0.02)
    with live(make_served(step_delay=0.1)) as served:
        response = _messages(served, max_tokens=3, messages=HI, stream=True)
        names = [line[7:] for line in response.text.splitlines() if line.startswith("event: ")]
        assert names[:4] == ["message_start", "content_block_start", "content_block_delta", "content_block_delta"]
        assert names[-1] == "message_stop"
        claude = anthropic.Anthropic(base_url=served.url, api_key="x", max_retries=0)
        with claude.messages.stream(model=MODEL, max_tokens=3, messages=HI) as stream:  # type: ignore[arg-type]
            final = stream.get_final_message()
        counted = claude.messages.count_tokens(model=MODEL, messages=HI).input_tokens  # type: ignore[arg-type]
        # message_start could not know the cached share yet; the final usage does.
        assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == counted
        assert (final.usage.cache_read_input_tokens or 0) > 0
