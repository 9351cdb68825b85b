"""How often the served model calls a tool on its own (tool_choice "auto"), per way of describing the tools.

    .venv/bin/python bench/tool_call_rate.py [--url http://...] [--max-tokens 96] [-- extra serve flags]

Without --url it starts `metalserve serve` (the embedded default model, SmolLM2-135M-Instruct) on a free port
with `--enable-auto-tool-choice --tool-call-parser generic`, and stops it at the end. Twelve short requests
that each want one tool (the weather in Paris, read hello.txt, 234 x 89, ...), greedy, through the openai SDK,
each described three ways:

- `generic`: the tools in the request's `tools`; the server writes its generic tool prompt (the chat template
  drops tools: api/generic_tools.py) and the `generic` parser reads the calls back.
- `explicit`: the same, with the user asking for the tool by name ("Call the get_weather tool to ...").
- `smollm2-native`: no `tools` field; the client writes SmolLM2's own function-calling system prompt (the
  form its instruct models were tuned on, as Ollama's SmolLM2 template writes it: the tools as a JSON list
  inside <tools></tools>, calls as a JSON list inside <tool_call></tool_call>) and parses the text itself.

Printed per form: requests with a parsed call to an offered tool, and the mean probability that the answer's
first token starts with "<" (the start of a call block; summed over the top 10 first tokens, so a lower bound).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import openai


def function(name: str, description: str, **params: tuple[str, str]) -> dict[str, Any]:
    """A chat-completions tool: `params` maps each argument to its (JSON type, description); all required."""
    properties = {k: {"type": t, "description": d} for k, (t, d) in params.items()}
    schema = {"type": "object", "properties": properties, "required": list(params)}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}


WEATHER = function("get_weather", "Get the current weather in a city", location=("string", "The city name"))
READ = function("Read", "Read a file from the local filesystem", file_path=("string", "The path of the file"))
SEARCH = function("web_search", "Search the web", query=("string", "The search query"))
CASES: list[tuple[str, list[dict[str, Any]]]] = [
    ("What is the weather in Paris?", [WEATHER]),
    ("Read the file hello.txt", [READ]),
    ("Read the file hello.txt and tell me the secret word in it.", [READ]),
    ("What is 234 multiplied by 89?", [function("calculator", "Evaluate arithmetic", expression=("string", "2*3"))]),
    ("Search the web for the latest news about Mars.", [SEARCH]),
    (
        "Send an email to bob@example.com saying that the meeting moved to 3pm.",
        [function("send_email", "Send an email", to=("string", "Recipient address"), body=("string", "The text"))],
    ),
    ("List the files in the /tmp directory.", [function("list_directory", "List a directory", path=("string", "Dir"))]),
    (
        "Convert 100 US dollars to euros.",
        [
            function(
                "convert_currency",
                "Convert an amount between currencies",
                amount=("number", "The amount"),
                from_currency=("string", "ISO code to convert from"),
                to_currency=("string", "ISO code to convert to"),
            )
        ],
    ),
    ("What time is it in Tokyo right now?", [function("get_time", "Current time", timezone=("string", "IANA zone"))]),
    (
        "Find flights from New York to London on 2025-01-05.",
        [
            function(
                "search_flights",
                "Search for flights",
                origin=("string", "Departure city"),
                destination=("string", "Arrival city"),
                date=("string", "YYYY-MM-DD"),
            )
        ],
    ),
    ("Run the command `ls -la` in the shell.", [function("Bash", "Run a shell command", command=("string", "Cmd"))]),
    ("What is the weather in Paris?", [WEATHER, READ, SEARCH]),
]

# SmolLM2's function-calling system prompt, quoted as its trained format (Ollama's smollm2 template).
SMOLLM2_PROMPT = (
    "You are an expert in composing functions. You are given a question and a set of possible functions.\n"
    "Based on the question, you will need to make one or more function/tool calls to achieve the purpose.\n"
    "If none of the functions can be used, point it out and refuse to answer.\n"
    "If the given question lacks the parameters required by the function, also point it out.\n\n"
    "You have access to the following tools:\n<tools>{tools}</tools>\n\n"
    "The output MUST strictly adhere to the following format, and NO other text MUST be included.\n"
    "The example format is as follows. Please make sure the parameter type is correct. If no function call "
    "is needed, please make the tool calls an empty list '[]'.\n"
    '<tool_call>[\n{{"name": "func_name1", "arguments": {{"argument1": "value1", "argument2": "value2"}}}},\n'
    "(more tool calls as required)\n]</tool_call>"
)
BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


@dataclass
class Outcome:
    called: bool
    p_open: float  # probability that the first token starts with "<"
    text: str


Form = Callable[[openai.OpenAI, str, str, list[dict[str, Any]], int], Outcome]


def first_token_p_open(choice: Any) -> float:
    top = choice.logprobs.content[0].top_logprobs if choice.logprobs and choice.logprobs.content else []
    return sum(math.exp(t.logprob) for t in top if t.token.lstrip().startswith("<"))


def served(explicit: bool) -> Form:
    """Tools in the request: the server's own prompt and parser."""

    def ask(client: openai.OpenAI, model: str, question: str, tools: list[dict[str, Any]], max_tokens: int) -> Outcome:
        if explicit:
            question = f"Call the {tools[0]['function']['name']} tool to answer this: {question}"
        answer = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": question}],
            tools=tools,  # type: ignore[arg-type]
            temperature=0,
            max_tokens=max_tokens,
            logprobs=True,
            top_logprobs=10,
        ).choices[0]
        message = answer.message
        return Outcome(bool(message.tool_calls), first_token_p_open(answer), message.content or "")

    return ask


def native_calls(text: str, names: set[str]) -> list[dict[str, Any]]:
    """The calls of SmolLM2's form in `text`: each block a JSON list of calls (a single object read too)."""
    calls: list[dict[str, Any]] = []
    for body in BLOCK.findall(text):
        try:
            value = json.loads(body)
        except ValueError:
            continue
        for call in value if isinstance(value, list) else [value]:
            if isinstance(call, dict) and call.get("name") in names and isinstance(call.get("arguments", {}), dict):
                calls.append(call)
    return calls


def smollm2_native(client: openai.OpenAI, model: str, question: str, tools: list[dict[str, Any]], n: int) -> Outcome:
    listed = json.dumps([t["function"] for t in tools], ensure_ascii=False)
    system = SMOLLM2_PROMPT.format(tools=listed)
    messages: list[Any] = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    answer = client.chat.completions.create(
        model=model,
        messages=messages,
        temperature=0,
        max_tokens=n,
        logprobs=True,
        top_logprobs=10,
    ).choices[0]
    text = answer.message.content or ""
    called = bool(native_calls(text, {t["function"]["name"] for t in tools}))
    return Outcome(called, first_token_p_open(answer), text)


FORMS: dict[str, Form] = {"generic": served(False), "explicit": served(True), "smollm2-native": smollm2_native}


def start_server(flags: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    defaults = ["--enable-auto-tool-choice", "--tool-call-parser", "generic", "--log-stats-interval", "0"]
    cmd = [sys.executable, "-m", "metalserve.cli", "serve", "--port", str(port), *defaults, *flags]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
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
    raise SystemExit("the server did not become healthy in 600 s")


def measure(url: str, max_tokens: int, verbose: bool) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=os.environ.get("OPENAI_API_KEY", "unused"), timeout=900)
    model = client.models.list().data[0].id
    print(f"model {model}, {len(CASES)} requests per form, temperature 0, max_tokens {max_tokens}")
    print(f"{'form':<16} {'calls':>7} {'mean P(<)':>10} {'seconds':>8}")
    for name, form in FORMS.items():
        start = time.monotonic()
        outcomes = [form(client, model, question, tools, max_tokens) for question, tools in CASES]
        calls = sum(o.called for o in outcomes)
        p_open = sum(o.p_open for o in outcomes) / len(outcomes)
        print(f"{name:<16} {calls:>3}/{len(outcomes):<3} {p_open:>10.3f} {time.monotonic() - start:>8.1f}", flush=True)
        if verbose:
            for (question, _), o in zip(CASES, outcomes, strict=True):
                print(f"    {o.called!s:<5} {question[:40]!r:<44} {o.text[:100]!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server (default: start one)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--verbose", action="store_true", help="print each answer's start")
    args, flags = parser.parse_known_args()
    if args.url:
        measure(args.url.rstrip("/"), args.max_tokens, args.verbose)
        return
    process, url = start_server([f for f in flags if f != "--"])
    try:
        measure(url, args.max_tokens, args.verbose)
    finally:
        process.terminate()
        process.wait(timeout=60)


if __name__ == "__main__":
    main()
