"""bench/agent_replay.py: a recorded agent session replayed against the real threaded server (fake core):
per turn TTFT (keep-alives do not count as output), prompt and cached tokens, prefill and decode rates."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.api.conftest import live, make_served

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import agent_replay  # noqa: E402

SYSTEM = "You are a coding agent. " * 20
TURN_1 = [{"role": "user", "content": "Read hello.txt"}]
TURN_2 = [*TURN_1, {"role": "assistant", "content": "It says hello."}, {"role": "user", "content": "Thanks"}]


def _messages(messages: list[dict[str, str]]) -> dict[str, object]:
    return {
        "path": "/v1/messages",
        "body": {"model": "claude", "system": SYSTEM, "max_tokens": 8, "messages": messages},
    }


def test_replays_a_session_turn_by_turn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("metalserve.api.keepalive.KEEPALIVE_SECONDS", 0.05)
    session = tmp_path / "claude_read.json"
    responses = {
        "path": "/v1/responses",
        "body": {"model": "x", "instructions": SYSTEM, "input": "Hi", "stream": False},
    }
    count = {"path": "/v1/messages/count_tokens", "body": {"messages": TURN_1}}
    requests = [_messages(TURN_1), count, _messages(TURN_2), responses]
    session.write_text(json.dumps({"agent": "claude", "requests": requests}))
    # The proxy's exchange form (what tests/agents/test_real_agents.py writes) is read too.
    exchanges = tmp_path / "codex_exchanges.json"
    exchanges.write_text(json.dumps([{"method": "POST", "path": "/v1/responses", "request": responses["body"]}]))
    out = tmp_path / "rows.json"
    with live(make_served(step_delay=0.3, max_model_len=4096)) as served:
        code = agent_replay.main([str(session), str(exchanges), "--url", served.url, "--json", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())
    assert [(r["session"], r["path"]) for r in rows] == [
        ("claude_read.json", "/v1/messages"),
        ("claude_read.json", "/v1/messages"),  # count_tokens is not a model turn
        ("claude_read.json", "/v1/responses"),
        ("codex_exchanges.json", "/v1/responses"),
    ]
    for row in rows:
        assert row["status"] == 200 and row["prompt_tokens"] > 0 and row["output_tokens"] > 0
        # The first token comes after a 0.3 s step; the keep-alives sent before it are not output.
        assert 0.25 < row["ttft"] <= row["seconds"]
    assert rows[0]["cached_tokens"] == 0 and rows[1]["cached_tokens"] > 0  # turn 2 reuses turn 1's prefix
    # --save keeps the requests of an exchanges file as a session file (what bench/data/agent_sessions holds).
    assert agent_replay.main([str(exchanges), "--save", str(tmp_path / "saved")]) == 0
    saved = json.loads((tmp_path / "saved" / "codex.json").read_text())
    assert saved == {"recorded_from": "codex_exchanges.json", "requests": [responses]}
    first = agent_replay.TurnResult(
        "/v1/messages", 200, 2.0, 4.0, prompt_tokens=1000, cached_tokens=200, output_tokens=21
    )
    assert first.prefill_tps() == pytest.approx(400.0) and first.decode_tps() == pytest.approx(10.0)
