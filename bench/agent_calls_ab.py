"""The tool-call A/B of bench/tool_calls_ab.py on the agents' own first requests: the first request of each
recorded session (bench/data/agent_sessions/: Claude Code's Messages and Codex's Responses requests, with
their system prompts and tools), in the chat form the server gives it (the Messages / Responses
translation), sent to /v1/chat/completions with logprobs so arm A can read the raw output.

    PYTHONPATH=$PWD .venv/bin/python bench/agent_calls_ab.py MODEL [SESSION.json ...] [--samples 4] \
        [--max-tokens 160] [--json out.json] [--verbose] [-- serve flags]

Two servers, one after the other (`--no-tool-call-grammar`, then with the grammar), as tool_calls_ab.py.
Each request is sent greedy once and at temperature 1 (the agents' own setting: Claude Code sends the
Messages default 1, Codex nothing, the server's default 1) with `--samples` seeds. Arms A (Hermes as it
was), B (forgiving), C (forgiving + constrained), tallied as there: answers with a call of a declared tool,
of those the answers whose every call has schema-valid arguments, right calls, invalid argument objects.
A right call is a declared tool whose arguments name the task's file: hello.txt (read), calc.py or
test_calc.py (fix).
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.agent_replay import SESSIONS, load_session  # noqa: E402
from bench.tool_calls_ab import Answer, _valid, report_settings, start_server  # noqa: E402
from metalserve.api.anthropic.protocol import MessagesRequest  # noqa: E402
from metalserve.api.anthropic.translate import to_chat as messages_to_chat  # noqa: E402
from metalserve.api.responses.protocol import ResponsesRequest  # noqa: E402
from metalserve.api.responses.translate import conversation  # noqa: E402
from metalserve.api.responses.translate import to_chat as responses_to_chat  # noqa: E402

# One session per agent and task (the 1.5B's Claude Code read session starts with the same request).
DEFAULT = [
    "claude_code_qwen2.5-coder-1.5b_read.json",
    "claude_code_qwen2.5-coder-0.5b_fix.json",
    "codex_qwen2.5-coder-0.5b_read.json",
    "codex_qwen2.5-coder-0.5b_fix.json",
]
TARGET = {"read": "hello.txt", "fix": "calc"}  # fix: reading or editing calc.py, or running its test


@dataclass(frozen=True)
class AgentCase:
    name: str
    body: dict[str, Any]  # the chat request, without model / sampling / max_tokens
    schemas: dict[str, dict[str, Any]]  # declared tool -> its parameters schema
    target: str  # what a right call's arguments mention


def chat_body(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The chat request the server makes of a recorded Messages or Responses request."""
    if path.startswith("/v1/messages"):
        chat = messages_to_chat(MessagesRequest(**body), reasoning=False)
    else:
        req = ResponsesRequest(**body)
        chat = responses_to_chat(req, conversation(req, []), reasoning=False)
    return chat.model_dump(mode="json", exclude_unset=True, exclude_none=True)


def load_case(path: Path) -> AgentCase:
    first = load_session(path)[0]
    body = chat_body(first["path"], first["body"])
    for key in ("model", "stream", "max_tokens", "temperature", "top_p", "stream_options"):
        body.pop(key, None)
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in body.get("tools") or []}
    task = "fix" if path.stem.endswith("_fix") else "read"
    return AgentCase(path.stem, body, schemas, TARGET[task])


def ask(url: str, model: str, case: AgentCase, temperature: float, seed: int, max_tokens: int) -> Answer:
    body = {**case.body, "model": model, "max_tokens": max_tokens, "temperature": temperature, "logprobs": True}
    if temperature > 0:
        body["seed"] = seed
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=3600)
    reply.raise_for_status()
    choice = reply.json()["choices"][0]
    message = choice["message"]
    raw = b"".join(bytes(t["bytes"] or []) for t in (choice.get("logprobs") or {}).get("content") or [])
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
    return Answer(message.get("content") or "", calls, raw.decode("utf-8", "replace"))


@dataclass
class Tally:
    answers: int = 0
    called: int = 0
    valid: int = 0
    right: int = 0
    invalid_objects: int = 0

    def add(self, case: AgentCase, answer: Answer) -> None:
        self.answers += 1
        calls = [(n, a) for n, a in answer.calls if n in case.schemas]
        if not calls:
            return
        self.called += 1
        ok = [_valid(a, case.schemas[n]) for n, a in calls]
        self.valid += all(ok)
        self.invalid_objects += ok.count(False)
        self.right += ok[0] and case.target in calls[0][1]


def run_arm(url: str, cases: list[AgentCase], settings: list[tuple[str, float, int]], args: Any) -> dict[str, Any]:
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    out: dict[str, list[Answer]] = {}
    with ThreadPoolExecutor(args.concurrency) as pool:
        for label, temperature, samples in settings:
            jobs = [(c, s) for c in cases for s in range(samples)]
            futures = [pool.submit(ask, url, model, c, temperature, 1000 + s, args.max_tokens) for c, s in jobs]
            out[label] = [f.result() for f in futures]
            print(f"  {label}: {len(futures)} answers", file=sys.stderr, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="the model to serve (a packaged name or a GGUF file)")
    parser.add_argument("sessions", nargs="*", type=Path, help="session files (default: one per agent and task)")
    parser.add_argument("--samples", type=int, default=4, help="seeds per request at temperature 1 (0: greedy only)")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--json", help="write every answer here")
    parser.add_argument("--verbose", action="store_true")
    args, extra = parser.parse_known_args()
    cases = [load_case(p) for p in args.sessions or [SESSIONS / n for n in DEFAULT]]
    settings = [("greedy", 0.0, 1)] + ([("T=1", 1.0, args.samples)] if args.samples else [])
    answers: dict[str, dict[str, list[Answer]]] = {}
    timing: dict[str, float] = {}
    for grammar in (False, True):
        process, url = start_server(args.model, grammar, [f for f in extra if f != "--"])
        try:
            start = time.monotonic()
            answers["on" if grammar else "off"] = run_arm(url, cases, settings, args)
            timing["on" if grammar else "off"] = time.monotonic() - start
        finally:
            process.terminate()
            process.wait(timeout=120)
    report(args, cases, settings, answers, timing)


def report(
    args: argparse.Namespace,
    cases: list[AgentCase],
    settings: list[tuple[str, float, int]],
    answers: dict[str, dict[str, list[Answer]]],
    timing: dict[str, float],
) -> None:
    print(f"model {args.model}; first requests of {[c.name for c in cases]}; max_tokens {args.max_tokens}")
    report_settings(
        settings,
        lambda samples: [c for c in cases for _ in range(samples)],
        answers,
        timing,
        args,
        tools_of=lambda c: set(c.schemas),
        new_tally=Tally,
        dump_row=lambda c, a: {"case": c.name, **a.__dict__},
        describe=lambda c: f"{c.name:<40}",
    )


if __name__ == "__main__":
    main()
