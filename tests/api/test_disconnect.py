"""A client that goes away mid-request: its engine request is aborted and its blocks freed."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from tests.api.conftest import Served, live, make_served


@pytest.fixture()
def slow() -> Iterator[Served]:
    with live(make_served(step_delay=0.02)) as served:
        yield served


def _wait_idle(served: Served) -> None:
    deadline = time.monotonic() + 10
    while served.core.running and time.monotonic() < deadline:
        time.sleep(0.02)


def test_stream_disconnect_aborts_and_frees(slow: Served) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "stream": True, "ignore_eos": True, "max_tokens": 100}
    with httpx.stream("POST", f"{slow.url}/v1/chat/completions", json=body) as response:
        for n, _ in enumerate(response.iter_lines()):
            if n > 3:
                break
    _wait_idle(slow)
    assert len(slow.core.aborted) == 1 and slow.core.used_blocks == 0
    after = httpx.post(f"{slow.url}/v1/chat/completions", json={**body, "stream": False, "max_tokens": 3})
    assert after.status_code == 200 and after.json()["choices"][0]["finish_reason"] == "length"


def test_non_streamed_disconnect_aborts(slow: Served) -> None:
    body = {"prompt": "Hi", "ignore_eos": True, "max_tokens": 100, "n": 2}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{slow.url}/v1/completions", json=body, timeout=0.3)
    _wait_idle(slow)
    assert len(slow.core.aborted) == 2 and slow.core.used_blocks == 0
