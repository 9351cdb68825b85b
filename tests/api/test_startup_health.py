"""Start-up through the real server: the port answers at once, `/health` is 503 {"status": "starting"}
(and other routes a 503 with Retry-After) while the model loads, 200 once it serves; the time to healthy
is logged; a load that fails stops the server with its error."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time

import httpx
import pytest
from fastapi import FastAPI

from metalserve.api import server as server_module
from metalserve.api.settings import ServerSettings
from metalserve.api.startup import serve_while_loading
from metalserve.config import EngineConfig
from tests.api.conftest import MODEL, app_of_engine, make_served


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_health_says_starting_until_the_model_serves(caplog: pytest.LogCaptureFixture) -> None:
    settings = ServerSettings(port=free_port(), log_stats_interval=0, graceful_shutdown_timeout=1)
    url = f"http://127.0.0.1:{settings.port}"
    loading = threading.Event()
    seen: dict[str, object] = {}

    def load() -> FastAPI:
        assert loading.wait(30)
        return app_of_engine(make_served().engine, settings)

    def client() -> None:
        try:
            deadline = time.monotonic() + 20
            while True:
                try:
                    health = httpx.get(f"{url}/health", timeout=5)
                    break
                except httpx.TransportError:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
            seen["starting"] = (health.status_code, health.json())
            models = httpx.get(f"{url}/v1/models", timeout=5)
            seen["models"] = (models.status_code, models.headers.get("retry-after"), models.json()["error"]["type"])
            loading.set()
            while (health := httpx.get(f"{url}/health", timeout=5)).status_code != 200:
                time.sleep(0.05)
            chat = httpx.post(
                f"{url}/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "say:ready"}], "max_tokens": 4},
                timeout=30,
            )
            seen["chat"] = chat.status_code
        finally:
            loading.set()
            os.kill(os.getpid(), signal.SIGINT)  # the server's own graceful stop

    threading.Thread(target=client, daemon=True).start()
    with caplog.at_level(logging.INFO, logger="metalserve.server"):
        serve_while_loading(load, settings)
    assert seen["starting"] == (503, {"status": "starting", "reason": "loading the model"})  # before: no answer
    assert seen["models"] == (503, "2", "service_unavailable")
    assert seen["chat"] == 200
    assert "ready: /health answers 200 after" in caplog.text


def test_a_failed_load_stops_the_server_with_its_error() -> None:
    settings = ServerSettings(port=free_port(), log_stats_interval=0)

    def load() -> FastAPI:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        serve_while_loading(load, settings)


def test_the_single_model_server_loads_behind_the_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []
    monkeypatch.setattr(server_module, "serve_while_loading", lambda load, settings: calls.append(load))
    server_module.run_server(EngineConfig(), ServerSettings(log_stats_interval=0))
    assert len(calls) == 1 and callable(calls[0])  # the model is loaded by the gate's thread, not before
