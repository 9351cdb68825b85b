"""The real server process: SIGTERM drains running streams, and an engine failure exits non-zero."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import _free_port

ROOT = Path(__file__).resolve().parents[2]
LONG = "say:" + " ".join(f"w{i}" for i in range(150))


@contextmanager
def fake_server(*args: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.api.serve_fake", str(port), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline and proc.poll() is None, "server did not start"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()


def _stream(url: str, events: list[list[str]], started: threading.Event) -> None:
    body = {"prompt": LONG, "max_tokens": 400, "stream": True}
    seen: list[str] = []
    events.append(seen)
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                seen.append(line[len("data: ") :])
                started.set()


def _last_event(lines: list[str]) -> dict[str, object]:
    assert lines and lines[-1] == "[DONE]", lines[-3:]
    return json.loads(lines[-2])  # type: ignore[no-any-return]


@pytest.mark.parametrize(("grace", "ends_with"), [("30", "finish"), ("0.3", "error")])
def test_sigterm_with_four_streams_in_flight(grace: str, ends_with: str) -> None:
    # 150 words at 20 ms a step: each stream needs about 3 s, so a 0.3 s grace cuts them.
    with fake_server(grace, "0.02") as (proc, url):
        events: list[list[str]] = []
        started = [threading.Event() for _ in range(4)]
        threads = [threading.Thread(target=_stream, args=(url, events, s)) for s in started]
        for t in threads:
            t.start()
        assert all(s.wait(20) for s in started)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
        for t in threads:
            t.join(timeout=30)
    assert proc.returncode == 0, output
    assert "Traceback" not in output
    for lines in events:
        last = _last_event(lines)
        if ends_with == "finish":
            assert last["choices"][0]["finish_reason"] in ("stop", "length")  # type: ignore[index]
        else:
            assert last["error"]["code"] == "503" and "shutting down" in last["error"]["message"]  # type: ignore[index]


def test_an_engine_failure_fails_requests_and_exits_non_zero() -> None:
    with fake_server("2", "0.01", "3") as (proc, url):
        response = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 50}, timeout=30)
        assert response.status_code == 503 and "internal error" in response.json()["error"]["message"]
        assert "simulated" not in response.text  # no internals in the body
        output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 1, output
    assert "exiting after the engine failed" in output
