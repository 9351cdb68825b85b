"""Replay coding-agent sessions against a server: the request sequences Claude Code and Codex really sent
(recorded by tests/agents/proxy.py), in order, streamed, one at a time. Per turn: TTFT, prompt and cached
tokens, prefill and decode tokens/s.

    .venv/bin/python bench/agent_replay.py --url http://127.0.0.1:8000 [SESSION.json ...] [--model NAME]

A session file is either bench/data/agent_sessions/*.json ({"recorded_from", "requests": [{"path", "body"}]};
`--save DIR` writes them from exchanges) or a `*_exchanges.json` that tests/agents/test_real_agents.py writes with
METALSERVE_AGENT_SUMMARY=DIR (the proxy's exchanges; count_tokens and other routes are skipped). Without
files it replays every session in bench/data/agent_sessions/. Each body goes out as recorded but with
`stream: true` and the served model's name, so the second turn on finds the first turn's prefix in the
cache as it did for the agent.

TTFT: from sending the request to the first event carrying model output (text, thinking, call arguments),
not to a keep-alive. Prefill tokens/s: (prompt - cached) / TTFT. Decode tokens/s: (output - 1) / (end - TTFT).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

SESSIONS = Path(__file__).parent / "data" / "agent_sessions"
ROUTES = ("/v1/messages", "/v1/responses", "/v1/chat/completions")


@dataclass
class TurnResult:
    path: str
    status: int
    ttft: float | None
    seconds: float
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0

    def prefill_tps(self) -> float | None:
        if not self.ttft or self.prompt_tokens <= self.cached_tokens:
            return None
        return (self.prompt_tokens - self.cached_tokens) / self.ttft

    def decode_tps(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2 or self.seconds <= self.ttft:
            return None
        return (self.output_tokens - 1) / (self.seconds - self.ttft)


def load_session(path: Path) -> list[dict[str, Any]]:
    """[{"path", "body"}] of a session file in either form, model requests only, in order."""
    data = json.loads(path.read_text())
    if isinstance(data, dict):
        requests = data["requests"]
    else:  # the proxy's exchanges
        requests = [{"path": e["path"], "body": e["request"]} for e in data if e.get("request") is not None]
    return [r for r in requests if r["path"].split("?")[0] in ROUTES]


def write_session(path: Path, requests: list[dict[str, Any]], source: str) -> None:
    """A session file: the model requests only (a recorded exchange also holds every streamed event)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"recorded_from": source, "requests": requests}, indent=1))


def is_output(event: dict[str, Any]) -> bool:
    """An event that carries model output (a keep-alive carries none)."""
    kind = event.get("type", "")
    if kind == "content_block_delta":
        delta = event.get("delta") or {}
        return bool(delta.get("text") or delta.get("thinking") or delta.get("partial_json"))
    if kind == "content_block_start":
        return (event.get("content_block") or {}).get("type") == "tool_use"
    if kind.startswith("response.") and kind.endswith(".delta"):
        return bool(event.get("delta"))
    if kind == "response.output_item.added":
        return (event.get("item") or {}).get("type") == "function_call"
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content"):
            return True
    return False


def read_usage(event: dict[str, Any], result: TurnResult) -> None:
    """Fill the result's token counts from whichever event of the three APIs carries usage."""
    usage = (
        event.get("usage") or (event.get("message") or {}).get("usage") or (event.get("response") or {}).get("usage")
    )
    if not usage:
        return
    if "cache_read_input_tokens" in usage:  # Anthropic: input_tokens is the uncached rest
        result.cached_tokens = usage.get("cache_read_input_tokens") or 0
        result.prompt_tokens = (usage.get("input_tokens") or 0) + result.cached_tokens
        result.output_tokens = usage.get("output_tokens") or result.output_tokens
    elif "input_tokens" in usage:  # Responses
        result.prompt_tokens = usage["input_tokens"]
        result.cached_tokens = (usage.get("input_tokens_details") or {}).get("cached_tokens") or 0
        result.output_tokens = usage.get("output_tokens") or 0
    else:  # chat
        result.prompt_tokens = usage.get("prompt_tokens") or 0
        result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        result.output_tokens = usage.get("completion_tokens") or 0


def replay_turn(client: httpx.Client, path: str, body: dict[str, Any], model: str) -> TurnResult:
    body = {**body, "model": model, "stream": True}
    if path.startswith("/v1/chat/completions"):
        body["stream_options"] = {"include_usage": True}
    headers = {"anthropic-version": "2023-06-01"} if path.startswith("/v1/messages") else {}
    start = time.monotonic()
    result = TurnResult(path, 0, None, 0.0)
    with client.stream("POST", path, json=body, headers=headers) as response:
        result.status = response.status_code
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if result.ttft is None and is_output(event):
                result.ttft = time.monotonic() - start
            read_usage(event, result)
    result.seconds = time.monotonic() - start
    return result


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sessions", nargs="*", type=Path, help="session files (default: bench/data/agent_sessions)")
    parser.add_argument("--url", default=None, help="the server root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="the model name to send (default: the server's first)")
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--json", type=Path, default=None, help="also write the per-turn results here")
    parser.add_argument("--save", type=Path, default=None, help="only write each file's requests as a session here")
    args = parser.parse_args(argv)
    files = args.sessions or sorted(SESSIONS.glob("*.json"))
    if not files:
        print(f"no session files (give some, or record them into {SESSIONS})", file=sys.stderr)
        return 2
    if args.save:
        for path in files:
            name = path.name.replace("_exchanges", "")
            write_session(args.save / name, load_session(path), source=path.name)
        return 0
    if not args.url:
        parser.error("--url is needed to replay")
    auth = {"authorization": f"Bearer {args.api_key}", "x-api-key": args.api_key}
    client = httpx.Client(base_url=args.url, timeout=None, headers=auth)
    model = args.model or client.get("/v1/models").json()["data"][0]["id"]
    print("session\tturn\troute\tstatus\tTTFT s\tprompt\tcached\tprefill tok/s\toutput\tdecode tok/s\ttotal s")
    rows = []
    for path in files:
        for n, request in enumerate(load_session(path), 1):
            r = replay_turn(client, request["path"], request["body"], model)
            rows.append({"session": path.name, "turn": n, **r.__dict__})
            print(
                f"{path.stem}\t{n}\t{r.path}\t{r.status}\t{_fmt(r.ttft, 2)}\t{r.prompt_tokens}\t{r.cached_tokens}\t"
                f"{_fmt(r.prefill_tps())}\t{r.output_tokens}\t{_fmt(r.decode_tps())}\t{r.seconds:.1f}",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
