"""A/B of tool calling under `tool_choice: auto`: the Hermes parser as it was, the forgiving parser, and the
forgiving parser with constrained calls (the lazy tool-call grammar).

    PYTHONPATH=$PWD .venv/bin/python bench/tool_calls_ab.py /work/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \
        [--samples 1] [--cases 20] [--max-tokens 160] [--concurrency 10] [--json out.json] [--verbose] [-- serve flags]

It starts `metalserve serve MODEL --enable-auto-tool-choice --tool-call-parser hermes` twice, one after the
other: with `--no-tool-call-grammar` (arms A and B read the same answers) and with the grammar (arm C).
Twenty chat requests, each offering three tools (JSON schemas with enums, bounds, arrays, nested objects)
and asking for what one of them does, are sent greedy and at the agents' sampling settings: Claude Code
sends `temperature: 1` and no top_p, Codex sends neither, and the server's default is temperature 1, top_p 1
(each sampled request with its own seed; `--samples` seeds per request).

- A, Hermes as on main: only `<tool_call>{...}</tool_call>` blocks of a declared tool, read from the raw
  output (rebuilt from the answer's logprob bytes).
- B, forgiving: the server's own answer (hermes parser: fences, other tags, bare objects, <function=...>).
- C, forgiving + constrained: the server's answer with the lazy grammar on.

Per arm: answers with a call of a declared tool; of those, answers whose every call's arguments validate
against the tool's schema (jsonschema); answers whose first call is the expected tool with the expected
key arguments; and the count of invalid argument objects.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jsonschema


def tool(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    schema = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}


S = {"type": "string"}
POOL = {
    "get_weather": tool(
        "get_weather",
        "Current weather for a city",
        {"city": S, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        ["city"],
    ),
    "read_file": tool(
        "read_file", "Read a text file", {"path": S, "max_lines": {"type": "integer", "minimum": 1}}, ["path"]
    ),
    "write_file": tool("write_file", "Write text to a file", {"path": S, "content": S}, ["path", "content"]),
    "run_shell": tool(
        "run_shell",
        "Run a shell command",
        {"command": S, "timeout_s": {"type": "integer", "minimum": 1, "maximum": 600}},
        ["command"],
    ),
    "search_web": tool(
        "search_web",
        "Search the web",
        {"query": S, "max_results": {"type": "integer", "minimum": 1, "maximum": 20}},
        ["query"],
    ),
    "send_email": tool(
        "send_email",
        "Send an email",
        {"to": {"type": "array", "items": S, "minItems": 1}, "subject": S, "body": S},
        ["to", "subject", "body"],
    ),
    "create_event": tool(
        "create_event",
        "Add an event to the calendar",
        {
            "title": S,
            "date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
            "duration_min": {"type": "integer", "minimum": 5},
        },
        ["title", "date"],
    ),
    "convert_currency": tool(
        "convert_currency",
        "Convert an amount between currencies",
        {
            "amount": {"type": "number", "exclusiveMinimum": 0},
            "from_currency": {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY"]},
            "to_currency": {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY"]},
        },
        ["amount", "from_currency", "to_currency"],
    ),
    "git_commit": tool(
        "git_commit", "Commit staged changes", {"message": S, "amend": {"type": "boolean"}}, ["message"]
    ),
    "create_issue": tool(
        "create_issue",
        "Open an issue in the tracker",
        {
            "title": S,
            "labels": {"type": "array", "items": {"type": "string", "enum": ["bug", "feature", "docs"]}},
            "assignee": {"type": "object", "properties": {"login": S}, "required": ["login"]},
        },
        ["title", "labels"],
    ),
    "set_timer": tool(
        "set_timer", "Start a countdown timer", {"minutes": {"type": "integer", "minimum": 1}}, ["minutes"]
    ),
    "translate": tool(
        "translate",
        "Translate text",
        {"text": S, "target_language": {"type": "string", "enum": ["fr", "de", "es", "ja"]}},
        ["text", "target_language"],
    ),
}


@dataclass(frozen=True)
class Case:
    ask: str
    tools: tuple[str, str, str]  # the first is the one to call
    expect: dict[str, Any]  # key arguments of the right call: equal, or a substring for strings


CASES = [
    Case("What's the weather in Paris right now?", ("get_weather", "search_web", "translate"), {"city": "Paris"}),
    Case(
        "Show me the first 20 lines of src/main.py", ("read_file", "write_file", "run_shell"), {"path": "src/main.py"}
    ),
    Case(
        "Create notes.txt containing the word hello", ("write_file", "read_file", "send_email"), {"path": "notes.txt"}
    ),
    Case("Run the test suite with pytest", ("run_shell", "read_file", "git_commit"), {"command": "pytest"}),
    Case(
        "Search the web for the release date of Python 3.14",
        ("search_web", "get_weather", "read_file"),
        {"query": "3.14"},
    ),
    Case(
        "Email alice@example.com that the build is green, subject 'CI'",
        ("send_email", "create_event", "write_file"),
        {"to": ["alice@example.com"]},
    ),
    Case(
        "Put 'Team sync' in my calendar on 2026-12-15",
        ("create_event", "send_email", "set_timer"),
        {"date": "2026-12-15"},
    ),
    Case("How much is 250 EUR in USD?", ("convert_currency", "search_web", "get_weather"), {"amount": 250}),
    Case(
        "Commit the staged changes with the message 'fix typo'",
        ("git_commit", "run_shell", "write_file"),
        {"message": "typo"},
    ),
    Case(
        "Open a bug titled 'Crash on empty input'",
        ("create_issue", "send_email", "git_commit"),
        {"title": "Crash on empty input"},
    ),
    Case("Set a timer for 15 minutes", ("set_timer", "create_event", "run_shell"), {"minutes": 15}),
    Case("Translate 'good morning' into German", ("translate", "search_web", "send_email"), {"target_language": "de"}),
    Case(
        "Is it raining in Tokyo? Use fahrenheit.", ("get_weather", "convert_currency", "set_timer"), {"city": "Tokyo"}
    ),
    Case("Read README.md and summarize it", ("read_file", "search_web", "translate"), {"path": "README.md"}),
    Case("List the files in the current directory", ("run_shell", "read_file", "write_file"), {"command": "ls"}),
    Case("Convert 100 GBP to JPY", ("convert_currency", "translate", "get_weather"), {"to_currency": "JPY"}),
    Case(
        "Find recent news about the Mars sample return mission",
        ("search_web", "read_file", "create_issue"),
        {"query": "Mars"},
    ),
    Case(
        "Save the text 'TODO: refactor' into todo.md",
        ("write_file", "git_commit", "create_issue"),
        {"path": "todo.md"},
    ),
    Case(
        "Translate 'thank you very much' to Japanese",
        ("translate", "send_email", "search_web"),
        {"target_language": "ja"},
    ),
    Case("Remind me in 45 minutes with a timer", ("set_timer", "send_email", "create_event"), {"minutes": 45}),
]


@dataclass
class Answer:
    content: str
    calls: list[tuple[str, str]]  # (name, arguments JSON text)
    raw: str = ""


@dataclass
class Tally:
    answers: int = 0
    called: int = 0
    valid: int = 0
    right: int = 0
    invalid_objects: int = 0
    seconds: float = 0.0
    examples: list[str] = field(default_factory=list)

    def add(self, case: Case, answer: Answer) -> None:
        self.answers += 1
        schemas = {n: POOL[n]["function"]["parameters"] for n in case.tools}
        calls = [(n, a) for n, a in answer.calls if n in schemas]
        if not calls:
            return
        self.called += 1
        ok = [_valid(a, schemas[n]) for n, a in calls]
        self.valid += all(ok)
        self.invalid_objects += ok.count(False)
        name, args = calls[0]
        self.right += name == case.tools[0] and ok[0] and _matches(json.loads(args), case.expect)


def _valid(arguments: str, schema: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(json.loads(arguments), schema, format_checker=jsonschema.FormatChecker())
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _matches(args: dict[str, Any], expect: dict[str, Any]) -> bool:
    for key, want in expect.items():
        got = args.get(key)
        if isinstance(want, str) and isinstance(got, str):
            if want.lower() not in got.lower():
                return False
        elif got != want:
            return False
    return True


HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def hermes_as_on_main(raw: str, names: set[str]) -> list[tuple[str, str]]:
    """main's hermes parser: only `<tool_call>` blocks holding a call object of a declared tool."""
    calls = []
    for body in HERMES_BLOCK.findall(raw):
        try:
            obj = json.loads(body)
        except ValueError:
            continue
        if isinstance(obj, dict) and obj.get("name") in names:
            args = obj.get("arguments", obj.get("parameters", {}))
            calls.append((obj["name"], args if isinstance(args, str) else json.dumps(args)))
    return calls


def ask(url: str, model: str, case: Case, temperature: float, seed: int, max_tokens: int) -> Answer:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": case.ask}],
        "tools": [POOL[n] for n in case.tools],
        "tool_choice": "auto",
        "max_tokens": max_tokens,
        "temperature": temperature,
        "logprobs": True,
    }
    if temperature > 0:
        body["seed"] = seed
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=1800)
    reply.raise_for_status()
    choice = reply.json()["choices"][0]
    message = choice["message"]
    raw = b"".join(bytes(t["bytes"] or []) for t in (choice.get("logprobs") or {}).get("content") or [])
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
    return Answer(message.get("content") or "", calls, raw.decode("utf-8", "replace"))


def start_server(model_path: str, grammar: bool, extra: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    flags = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--log-stats-interval", "0"]
    flags += [] if grammar else ["--no-tool-call-grammar"]
    cmd = [sys.executable, "-m", "metalserve.cli", "serve", model_path, "--port", str(port), *flags, *extra]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    process.terminate()
    raise SystemExit("the server did not become healthy in 900 s")


def run_arm(url: str, settings: list[tuple[str, float, int]], args: argparse.Namespace) -> dict[str, list[Answer]]:
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    out: dict[str, list[Answer]] = {}
    with ThreadPoolExecutor(args.concurrency) as pool:
        for label, temperature, samples in settings:
            jobs = [(c, s) for s in range(samples) for c in CASES]
            futures = [pool.submit(ask, url, model, c, temperature, 1000 + s, args.max_tokens) for c, s in jobs]
            out[label] = []
            for f in futures:
                out[label].append(f.result())
                print(f"  {label}: {len(out[label])}/{len(futures)} answers", file=sys.stderr, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="the GGUF file (or any model metalserve serves)")
    parser.add_argument("--samples", type=int, default=1, help="seeds per request at temperature 1 (0: greedy only)")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--json", help="write every answer here")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--cases", type=int, default=len(CASES), help="only the first N requests (a busy CPU)")
    args, extra = parser.parse_known_args()
    CASES[:] = CASES[: args.cases]
    settings = [("greedy", 0.0, 1)] + ([("T=1", 1.0, args.samples)] if args.samples else [])
    answers: dict[str, dict[str, list[Answer]]] = {}
    timing: dict[str, float] = {}
    for grammar in (False, True):
        process, url = start_server(args.model, grammar, [f for f in extra if f != "--"])
        try:
            start = time.monotonic()
            answers["on" if grammar else "off"] = run_arm(url, settings, args)
            timing["on" if grammar else "off"] = time.monotonic() - start
        finally:
            process.terminate()
            process.wait(timeout=120)
    report(args, settings, answers, timing)


def report(
    args: argparse.Namespace,
    settings: list[tuple[str, float, int]],
    answers: dict[str, dict[str, list[Answer]]],
    timing: dict[str, float],
) -> None:
    print(f"model {args.model}; {len(CASES)} requests x 3 tools; max_tokens {args.max_tokens}")
    report_settings(
        settings,
        lambda samples: [c for _ in range(samples) for c in CASES],
        answers,
        timing,
        args,
        tools_of=lambda c: set(c.tools),
        new_tally=Tally,
        dump_row=lambda c, a: a.__dict__,
        describe=lambda c: f"{c.ask[:38]!r:<42}",
    )


def report_settings(
    settings: list[tuple[str, float, int]],
    jobs_of: Any,
    answers: dict[str, dict[str, list[Answer]]],
    timing: dict[str, float],
    args: argparse.Namespace,
    **arms: Any,
) -> None:
    """The wall times, then report_arms for each sampling setting (`jobs_of(samples)`: the case of each
    answer, in the order asked), and the answers to `args.json`. Shared with bench/agent_calls_ab.py."""
    print(f"wall: grammar off {timing['off']:.0f} s, grammar on {timing['on']:.0f} s (same requests)")
    print(f"{'sampling':<8} {'arm':<34} {'declared call':>14} {'valid args':>11} {'right call':>11} {'invalid':>8}")
    dump: dict[str, Any] = {}
    for label, _, samples in settings:
        dump |= report_arms(label, jobs_of(samples), answers, verbose=args.verbose, **arms)
    if args.json:
        Path(args.json).write_text(json.dumps(dump, indent=1))


def report_arms(
    label: str,
    jobs: list[Any],
    answers: dict[str, dict[str, list[Answer]]],
    *,
    tools_of: Any,
    new_tally: Any,
    dump_row: Any,
    describe: Any,
    verbose: bool,
) -> dict[str, Any]:
    """Print the three arms' tallies of one sampling setting (`jobs`: the case of each answer, in order);
    return the answers for the JSON dump. Arm A reads the grammar-off answers' raw text as the Hermes
    parser on main did (only the declared `tools_of(case)`); B is those answers as served; C the
    grammar-on ones. Shared with bench/agent_calls_ab.py, whose cases and tallies differ."""
    arms = {
        "A hermes as on main": [
            Answer(a.content, hermes_as_on_main(a.raw, tools_of(c)), a.raw)
            for c, a in zip(jobs, answers["off"][label], strict=True)
        ],
        "B forgiving parser": answers["off"][label],
        "C forgiving + constrained calls": answers["on"][label],
    }
    dump: dict[str, Any] = {}
    for arm, got in arms.items():
        tally = new_tally()
        for case, answer in zip(jobs, got, strict=True):
            tally.add(case, answer)
        n = tally.answers
        print(
            f"{label:<8} {arm:<34} {tally.called:>6}/{n:<3} {_pct(tally.called, n):>4} "
            f"{tally.valid:>3}/{tally.called:<3} {tally.right:>4}/{n:<3} {tally.invalid_objects:>5}"
        )
        dump[f"{label} {arm}"] = [dump_row(c, a) for c, a in zip(jobs, got, strict=True)]
        if verbose:
            for case, answer in zip(jobs, got, strict=True):
                print(f"      {describe(case)} {answer.calls[:1]!s:.80} {answer.raw[:80]!r}")
    return dump


def _pct(a: int, b: int) -> str:
    return f"{100 * a // max(b, 1)}%"


if __name__ == "__main__":
    main()
