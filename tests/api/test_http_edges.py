"""HTTP edges a careless or hostile client finds: slow or short bodies, disconnects, the auth scheme's
case, and integers sent as strings or booleans (all three APIs)."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from metalserve.api.settings import ServerSettings
from tests.api.conftest import MODEL, Served, live, make_served


@pytest.fixture(scope="module")
def keyed() -> Iterator[Served]:
    settings = ServerSettings(api_key="sekrit", log_stats_interval=0, request_body_timeout=0.5)
    with live(make_served(settings, step_delay=0.02)) as served:
        yield served


def _raw(served: Served, data: bytes) -> socket.socket:
    host, port = served.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(data)
    return sock


def test_a_body_shorter_than_its_content_length_times_out(keyed: Served) -> None:
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekrit\r\n"
        b'Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"model": '
    )
    sock = _raw(keyed, head)
    start = time.monotonic()
    reply = b""
    while chunk := sock.recv(65536):
        reply += chunk
    sock.close()
    assert time.monotonic() - start < 5, "the connection was held open"
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"request body" in reply


def test_a_complete_body_is_unaffected_by_the_timeout(keyed: Served) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "say:hi"}], "max_tokens": 2}
    response = httpx.post(f"{keyed.url}/v1/chat/completions", json=body, headers={"authorization": "Bearer sekrit"})
    assert response.status_code == 200


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_the_auth_scheme_is_case_insensitive(keyed: Served, scheme: str) -> None:
    response = httpx.get(f"{keyed.url}/v1/models", headers={"authorization": f"{scheme} sekrit"})
    assert response.status_code == 200
    wrong = httpx.get(f"{keyed.url}/v1/models", headers={"authorization": f"{scheme} nope"})
    assert wrong.status_code == 401
    assert httpx.get(f"{keyed.url}/v1/models", headers={"authorization": "Basic sekrit"}).status_code == 401


def test_client_disconnects_log_no_error_tracebacks(keyed: Served, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    headers = {"authorization": "Bearer sekrit"}
    # A body cut off by the client closing the socket.
    sock = _raw(keyed, b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nx-api-key: sekrit\r\nContent-Length: 500\r\n\r\n{")
    sock.close()
    # Streams the client leaves half way, in each API, and a non-streamed request it gives up on.
    messages = [{"role": "user", "content": "Hi"}]
    for path, body in (
        ("/v1/chat/completions", {"messages": messages, "ignore_eos": True, "max_tokens": 200}),
        ("/v1/messages", {"messages": messages, "max_tokens": 200}),
        ("/v1/responses", {"input": "Hi", "max_output_tokens": 200}),
    ):
        with httpx.stream(
            "POST", f"{keyed.url}{path}", json={"model": MODEL, "stream": True, **body}, headers=headers
        ) as response:
            for n, _ in enumerate(response.iter_lines()):
                if n > 3:
                    break
    with pytest.raises(httpx.ReadTimeout):
        body = {"model": MODEL, "prompt": "Hi", "ignore_eos": True, "max_tokens": 200, "n": 2}
        httpx.post(f"{keyed.url}/v1/completions", json=body, headers=headers, timeout=0.3)
    time.sleep(1.0)
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not bad, [(r.name, r.getMessage()) for r in bad]


def _post(served: Served, path: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{served.url}{path}", json=body, headers={"authorization": "Bearer sekrit"})


MESSAGES = [{"role": "user", "content": "say:hi"}]


@pytest.mark.parametrize("value", ["10", True, 10.0])
@pytest.mark.parametrize(
    ("path", "field", "extra"),
    [
        ("/v1/messages", "max_tokens", {"messages": MESSAGES}),
        ("/v1/chat/completions", "max_tokens", {"messages": MESSAGES}),
        ("/v1/chat/completions", "n", {"messages": MESSAGES}),
        ("/v1/completions", "max_tokens", {"prompt": "hi"}),
        ("/v1/responses", "max_output_tokens", {"input": "hi"}),
    ],
)
def test_integers_must_be_integers(
    keyed: Served, path: str, field: str, extra: dict[str, object], value: object
) -> None:
    body = {"model": MODEL, **extra, field: value}
    if path == "/v1/messages" and field != "max_tokens":
        body["max_tokens"] = 4
    response = _post(keyed, path, body)
    assert response.status_code == 400, response.text
    assert field in response.text
    ok = _post(keyed, path, {**body, field: 2})
    assert ok.status_code == 200, ok.text
