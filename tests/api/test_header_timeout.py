"""A client that sends its request headers slowly is cut off (the protocol serve_app gives uvicorn);
complete requests, kept-alive connections and slow bodies are not."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import FastAPI

from metalserve.api import header_timeout
from metalserve.api.header_timeout import HeaderTimeoutProtocol

DEADLINE = 0.6


@pytest.fixture
def port(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    monkeypatch.setattr(header_timeout, "HEADER_TIMEOUT_S", DEADLINE)
    app = FastAPI()

    @app.post("/echo")
    async def echo(body: dict[str, str]) -> dict[str, str]:
        return body

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    config = uvicorn.Config(app, host="127.0.0.1", port=free, log_level="warning", http=HeaderTimeoutProtocol)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield free
    server.should_exit = True
    thread.join(10)


def closed_by_server(conn: socket.socket, within: float) -> bool:
    conn.settimeout(within)
    try:
        return conn.recv(1024) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_headers_that_trickle_in_are_cut_off(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as conn:
        started = time.monotonic()
        for piece in (b"POST /echo HTTP/1.1\r\n", b"Host: x\r\n"):
            conn.sendall(piece)
            time.sleep(DEADLINE / 4)
        assert closed_by_server(conn, 5 * DEADLINE)  # before: held open for as long as the client liked
        assert time.monotonic() - started < 4 * DEADLINE


def test_a_silent_connection_is_cut_off_too(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as conn:
        assert closed_by_server(conn, 5 * DEADLINE)


def test_complete_requests_on_a_kept_alive_connection_and_a_slow_body_are_served(port: int) -> None:
    body = b'{"a": "b"}'
    head = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.settimeout(5)
        for _ in range(2):
            conn.sendall(head % len(body))
            time.sleep(2 * DEADLINE)  # the headers are in: a slow body is the app's matter, not this deadline
            conn.sendall(body)
            reply = b""
            while not reply.endswith(b'{"a":"b"}'):
                reply += conn.recv(4096)
            assert reply.startswith(b"HTTP/1.1 200")


def test_the_server_runs_uvicorn_with_this_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    from metalserve.api import server
    from metalserve.api.settings import ServerSettings

    seen: list[object] = []

    class Recorder:
        engine_failed = False

        def __init__(self, config: uvicorn.Config, engine: object, grace_s: float) -> None:
            seen.append(config.http)

        def run(self) -> None:
            pass

    monkeypatch.setattr(server, "GracefulServer", Recorder)
    app = FastAPI()
    app.state.registry = None
    server.serve_app(app, ServerSettings(log_stats_interval=0))
    assert seen == [HeaderTimeoutProtocol]
