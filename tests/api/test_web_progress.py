"""What the page polls: one response's prefill progress while its first token is awaited, the prompt
tokens of a request aborted before any output, memory parts that add up, and a favicon open like the page."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import httpx
import pytest

from metalserve.api import status
from metalserve.api.settings import ServerSettings
from tests.api.conftest import MODEL, live, make_served

HI = [{"role": "user", "content": "Hi there"}]


def _first_event(lines: object) -> dict[str, object]:
    for line in lines:  # type: ignore[attr-defined]
        if line.startswith("data:"):
            return dict(json.loads(line[5:]))
    raise AssertionError("no event")


def test_a_running_response_shows_its_prompt_progress_and_is_gone_when_it_ends() -> None:
    with live(make_served(step_delay=0.3)) as served:
        body = {"model": MODEL, "messages": HI, "stream": True, "max_tokens": 3}
        with httpx.stream("POST", f"{served.url}/v1/chat/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            response_id = _first_event(lines)["id"]  # the role chunk comes before any token
            progress = httpx.get(f"{served.url}/v1/server/requests/{response_id}", timeout=10).json()
            (running,) = progress["requests"]
            assert running["request_id"] == response_id and running["model"] == MODEL
            assert running["prompt_tokens"] > 0 and running["prompt_tokens_done"] == 0
            assert running["output_tokens"] == 0
            status = httpx.get(f"{served.url}/v1/server/status", timeout=10).json()
            assert [r["request_id"] for r in status["running_requests"]] == [response_id]
            for _ in lines:
                pass
        progress = httpx.get(f"{served.url}/v1/server/requests/{response_id}", timeout=10).json()
        assert progress == {"id": response_id, "requests": []}


def test_a_request_aborted_before_its_first_token_reports_its_prompt_tokens() -> None:
    with live(make_served(step_delay=1.0)) as served:
        body = {"model": MODEL, "messages": HI, "stream": True, "max_tokens": 3}
        with httpx.stream("POST", f"{served.url}/v1/chat/completions", json=body, timeout=30) as response:
            _first_event(response.iter_lines())
        deadline = time.monotonic() + 10
        while not (recent := httpx.get(f"{served.url}/v1/server/status", timeout=10).json()["recent_requests"]):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        (aborted,) = recent
        assert aborted["status"] == "aborted" and aborted["output_tokens"] == 0
        assert aborted["prompt_tokens"] == len(served.core.added[0].prompt_token_ids)


def test_the_favicon_is_open_like_the_page() -> None:
    settings = ServerSettings(api_key="sekret", log_stats_interval=0)
    with live(make_served(settings)) as served:
        icon = httpx.get(f"{served.url}/favicon.ico", timeout=10)
        assert icon.status_code == 200 and icon.headers["content-type"] == "image/x-icon"
        assert icon.content[:4] == b"\x00\x00\x01\x00"  # an ICO header
        assert httpx.get(f"{served.url}/web/favicon.svg", timeout=10).status_code == 200
        assert httpx.get(f"{served.url}/v1/server/requests/x", timeout=10).status_code == 401


def test_head_on_the_page_answers_like_get() -> None:
    """Claude Code sends `HEAD /` before each run: before, a 405."""
    with live(make_served(ServerSettings(log_stats_interval=0))) as served:
        head = httpx.head(f"{served.url}/", timeout=10)
        assert head.status_code == 200 and head.headers["content-type"].startswith("text/html")
        assert head.content == b""


def test_the_memory_parts_add_up_to_the_resident_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights + KV in use + KV grown but free + other = RSS; the pools' reserved size is reported apart."""
    core = SimpleNamespace(
        memory_report=lambda: {"weights": 1000, "kv_pool": 400}, kv_bytes_per_block=10, kv_pool_bytes=1000
    )
    slot = SimpleNamespace(engine=SimpleNamespace(core=core))
    memory = status.model_memory(slot, used_blocks=7)  # type: ignore[arg-type]
    assert memory == {
        "weights_bytes": 1000,
        "kv_in_use_bytes": 70,
        "kv_allocated_bytes": 400,
        "kv_reserved_bytes": 1000,
    }
    monkeypatch.setattr(status, "process_rss", lambda: 5000)
    registry = SimpleNamespace(memory_budget=9000, used_bytes=lambda: 2000)
    summary = status.memory_summary(registry, [{"memory": memory}, {"memory": None}])  # type: ignore[arg-type]
    parts = ("weights_bytes", "kv_in_use_bytes", "kv_free_bytes", "other_bytes")
    assert [summary[p] for p in parts] == [1000, 70, 330, 3600]
    assert sum(summary[p] for p in parts) == summary["process_rss_bytes"] == 5000
    assert summary["kv_reserved_bytes"] == 1000 and summary["kv_not_allocated_bytes"] == 600
    assert summary["models_bytes"] == 2000 and summary["budget_bytes"] == 9000
