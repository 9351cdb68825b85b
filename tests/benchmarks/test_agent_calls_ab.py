"""bench/agent_calls_ab.py: the agents' recorded first requests in the chat form the server makes of them,
and the tally of declared, schema-valid and right calls on them."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `bench.` imports

from bench import agent_calls_ab  # noqa: E402
from bench.agent_calls_ab import DEFAULT, Tally, load_case  # noqa: E402
from bench.agent_replay import SESSIONS  # noqa: E402
from bench.tool_calls_ab import Answer, hermes_as_on_main, report_arms  # noqa: E402


def test_first_requests_keep_the_agents_prompt_and_tools() -> None:
    cases = {c.name: c for c in (load_case(SESSIONS / n) for n in DEFAULT)}
    claude = cases["claude_code_qwen2.5-coder-1.5b_read"]
    assert list(claude.schemas) == ["Read"] and claude.target == "hello.txt"
    assert claude.schemas["Read"]["required"] == ["file_path"]
    assert claude.body["messages"][0]["role"] == "system"  # Claude Code's system prompt, as the server renders it
    assert not {"model", "stream", "max_tokens", "temperature"} & set(claude.body)  # the bench sets those
    assert set(cases["claude_code_qwen2.5-coder-0.5b_fix"].schemas) == {"Bash", "Edit", "Read"}
    codex = cases["codex_qwen2.5-coder-0.5b_fix"]
    assert "exec_command" in codex.schemas and codex.target == "calc"
    assert "spawn_agent" in codex.schemas  # a namespace's tools are flattened as the server does


def test_tally_counts_declared_valid_and_right_calls() -> None:
    case = load_case(SESSIONS / DEFAULT[0])
    tally = Tally()
    tally.add(case, Answer("", [("Read", json.dumps({"file_path": "/tmp/w/hello.txt"}))]))  # right
    tally.add(case, Answer("", [("Read", json.dumps({"file_path": "notes.md"}))]))  # valid, wrong file
    tally.add(case, Answer("", [("Read", json.dumps({"path": "hello.txt"}))]))  # no file_path: invalid
    tally.add(case, Answer("", [("read_file", json.dumps({"file_path": "hello.txt"}))]))  # undeclared
    tally.add(case, Answer("The secret word is unknown.", []))
    assert (tally.answers, tally.called, tally.valid, tally.right, tally.invalid_objects) == (5, 3, 2, 1, 1)


def test_arm_a_reads_only_tool_call_blocks_of_declared_tools() -> None:
    raw = '```json\n{"name": "Read", "arguments": {"file_path": "a"}}\n```<tool_call>{"name": "Read", "arguments": {}}'
    assert hermes_as_on_main(raw, {"Read"}) == []
    block = '<tool_call>\n{"name": "Read", "arguments": {"file_path": "a"}}\n</tool_call>'
    assert hermes_as_on_main(block, {"Read"}) == [("Read", '{"file_path": "a"}')]
    assert hermes_as_on_main(block, {"Bash"}) == []


def test_the_arms_report_tallies_each_arm_and_dumps_every_answer(capsys: Any) -> None:
    """report_arms (shared with bench/tool_calls_ab.py): arm A re-reads the grammar-off raw text as main's
    Hermes parser did, B takes those answers as served, C the grammar-on ones."""
    case = load_case(SESSIONS / DEFAULT[0])
    fenced = '```json\n{"name": "Read", "arguments": {"file_path": "/w/hello.txt"}}\n```'
    right = Answer("", [("Read", json.dumps({"file_path": "/w/hello.txt"}))], fenced)
    answers = {"off": {"greedy": [right, Answer("no call", [], "no call")]}, "on": {"greedy": [right, right]}}
    dump = report_arms(
        "greedy",
        [case, case],
        answers,
        tools_of=lambda c: set(c.schemas),
        new_tally=Tally,
        dump_row=lambda c, a: {"case": c.name, **a.__dict__},
        describe=lambda c: c.name,
        verbose=False,
    )
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[-5:-3] for line in lines] == [["0/2", "0%"], ["1/2", "50%"], ["2/2", "100%"]]
    assert len(dump["greedy B forgiving parser"]) == 2 and dump["greedy C forgiving + constrained calls"][0]["case"]


def test_the_report_covers_every_setting_and_writes_the_answers(capsys: Any, tmp_path: Path) -> None:
    """agent_calls_ab.report (through tool_calls_ab.report_settings): the wall times, a header, three arm rows
    per sampling setting, each case repeated `samples` times, and every answer in the JSON file."""
    case = load_case(SESSIONS / DEFAULT[0])
    right = Answer("", [("Read", json.dumps({"file_path": "/w/hello.txt"}))], "raw")
    answers = {arm: {"greedy": [right], "T=1": [right, right]} for arm in ("off", "on")}
    out = tmp_path / "answers.json"
    args = argparse.Namespace(model="m", max_tokens=8, verbose=False, json=str(out))
    settings = [("greedy", 0.0, 1), ("T=1", 1.0, 2)]
    agent_calls_ab.report(args, [case], settings, answers, {"off": 1.0, "on": 2.0})
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("wall: grammar off 1 s") and lines[2].split()[:2] == ["sampling", "arm"]
    assert [line.split()[0] for line in lines[3:]] == ["greedy"] * 3 + ["T=1"] * 3
    dump = json.loads(out.read_text())
    assert len(dump) == 6 and len(dump["T=1 C forgiving + constrained calls"]) == 2
