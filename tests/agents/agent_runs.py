"""Running the real coding agents (Claude Code, Codex) from `make agents` against a server, through the
recording proxy, and summarising what went over the wire."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.agents.proxy import Exchange

ROOT = Path(__file__).resolve().parents[2]
AGENTS_BIN = ROOT / ".agents" / "node_modules" / ".bin"
SECRET = "pineapple"


def missing_agent(binary: str) -> str | None:
    """Why an agent cannot run here (None when it can)."""
    if shutil.which("node") is None:
        return "node is not installed (apt-get install -y nodejs npm)"
    if not (AGENTS_BIN / binary).exists():
        return f"{binary} is not installed: run `make agents` (npm, into .agents/)"
    return None


@dataclass
class Turn:
    """One model request of an agent's run."""

    path: str
    status: int
    seconds: float
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    tool_calls: list[str] = field(default_factory=list)  # names the answer called


@dataclass
class AgentRun:
    returncode: int
    stdout: str
    stderr: str
    wall_seconds: float
    turns: list[Turn]
    exchanges: list[Exchange]
    agent: str = "claude"  # or "codex": where the final answer is

    def answer(self) -> str:
        """The agent's final answer: `claude -p --output-format json`'s result, or codex exec's last message."""
        if self.agent == "claude":
            try:
                return str(json.loads(self.stdout).get("result") or "")
            except ValueError:
                return self.stdout
        return self.stdout.strip()

    def summary(self) -> dict[str, Any]:
        return {
            "returncode": self.returncode,
            "wall_seconds": round(self.wall_seconds, 1),
            "requests": len(self.turns),
            "turns": [t.__dict__ for t in self.turns],
            "tool_calls": [{"name": n, "arguments": a} for n, a in tool_calls(self.exchanges)],
            "answer": self.answer()[-2000:],
        }


def run_agent(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, str, str, float]:
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=cwd, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stdout, done.stderr, time.monotonic() - start


def messages_turn(exchange: Exchange) -> Turn:
    """Usage and tool calls of a /v1/messages answer (streamed or not)."""
    turn = Turn(exchange.path, exchange.status, exchange.seconds)
    events = exchange.events() or ([exchange.body()] if isinstance(exchange.body(), dict) else [])
    for event in events:
        usage = event.get("usage") or (event.get("message") or {}).get("usage")
        if usage:
            cached = usage.get("cache_read_input_tokens") or 0
            turn.cached_tokens = cached
            turn.prompt_tokens = (usage.get("input_tokens") or 0) + cached
            turn.output_tokens = usage.get("output_tokens") or 0
        blocks = [event.get("content_block") or {}] + list(event.get("content") or [])
        turn.tool_calls += [b["name"] for b in blocks if b.get("type") == "tool_use"]
    return turn


def responses_turn(exchange: Exchange) -> Turn:
    """Usage and function calls of a /v1/responses answer (streamed or not)."""
    turn = Turn(exchange.path, exchange.status, exchange.seconds)
    events = exchange.events()
    ends = ("response.completed", "response.incomplete")
    final = next((e["response"] for e in events if e.get("type") in ends), None)
    body = final or exchange.body() or {}
    usage = body.get("usage") or {}
    turn.prompt_tokens = usage.get("input_tokens") or 0
    turn.cached_tokens = (usage.get("input_tokens_details") or {}).get("cached_tokens") or 0
    turn.output_tokens = usage.get("output_tokens") or 0
    turn.tool_calls = [i["name"] for i in body.get("output") or [] if i.get("type") == "function_call"]
    return turn


def sent_tool_result(exchanges: list[Exchange]) -> bool:
    """Whether a request carried a tool's result back (a tool_result block or a function_call_output item)."""
    for exchange in exchanges:
        body = exchange.request if isinstance(exchange.request, dict) else {}
        for message in body.get("messages") or []:
            content = message.get("content")
            if isinstance(content, list) and any(b.get("type") == "tool_result" for b in content):
                return True
        items = body.get("input")
        if isinstance(items, list) and any(i.get("type") == "function_call_output" for i in items):
            return True
    return False


def write_json(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=1))


def tool_calls(exchanges: list[Exchange]) -> list[tuple[str, str]]:
    """(name, arguments JSON) of every call the server's answers made, Messages or Responses, streamed or not."""
    calls: list[tuple[str, str]] = []
    for exchange in exchanges:
        events = exchange.events()
        body = exchange.body() if not events else None
        if isinstance(body, dict):  # a plain JSON answer
            calls += [
                (b["name"], json.dumps(b.get("input")))
                for b in body.get("content") or []
                if b.get("type") == "tool_use"
            ]
            calls += [
                (i["name"], i.get("arguments", ""))
                for i in body.get("output") or []
                if i.get("type") == "function_call"
            ]
        open_calls: dict[int, list[str]] = {}
        for event in events:
            kind = event.get("type")
            if kind == "content_block_start" and event["content_block"].get("type") == "tool_use":
                open_calls[event["index"]] = [event["content_block"]["name"], ""]
            elif kind == "content_block_delta" and event["index"] in open_calls:
                open_calls[event["index"]][1] += event["delta"].get("partial_json", "")
            elif kind == "content_block_stop" and event["index"] in open_calls:
                name, arguments = open_calls.pop(event["index"])
                calls.append((name, arguments))
            elif kind == "response.output_item.done" and event["item"].get("type") == "function_call":
                calls.append((event["item"]["name"], event["item"].get("arguments", "")))
    return calls
