"""Claude Code (`claude -p`) and Codex (`codex exec`) against the real server and the default model,
RoPE-extended so their prompts fit, on a short task: each must call a tool, send its result back and exit 0.

Slow (a CPU prefill of an agent's prompt takes minutes); skipped, saying why, without node or the agents
(`make agents`). `METALSERVE_AGENT_SUMMARY=DIR` writes each run's summary (wall time, requests, prompt
and cached tokens per turn) and its recorded exchanges there.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agents.agent_runs import (
    AGENTS_BIN,
    SECRET,
    TASK,
    AgentRun,
    messages_turn,
    missing_agent,
    responses_turn,
    run_agent,
    sent_tool_result,
    write_json,
)
from tests.agents.proxy import recording_proxy
from tests.e2e.server import RunningServer, running_server

AGENT_TIMEOUT = 2400.0  # seconds: minutes of CPU prefill per first turn on a busy machine
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * AGENT_TIMEOUT)]

# The default model's 8,192 tokens stretched 2x: Codex's prompt is ~9,300 tokens. Claude Code runs with its
# Read tool only (~2,200 tokens; all its tools make ~20,400, which needs factor 4, and a linear factor 4
# leaves this 135M model incoherent).
SERVER_FLAGS = (
    "--hf-overrides",
    '{"rope_scaling": {"rope_type": "linear", "factor": 2.0}}',
    "--max-model-len",
    "16384",
    "--allow-long-max-model-len",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "generic",
    "--kv-cache-memory",
    str(2 << 30),
)
IDLE_MS = str(int(AGENT_TIMEOUT * 1000))


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    for binary in ("claude", "codex"):
        if missing_agent(binary) is not None:
            pytest.skip(str(missing_agent(binary)))
    with running_server(*SERVER_FLAGS) as s:
        yield s


def _workdir(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    (work / "hello.txt").write_text(f"The secret word is {SECRET}.\n")
    return work


def _record(name: str, run: AgentRun) -> None:
    where = os.environ.get("METALSERVE_AGENT_SUMMARY")
    print(name, run.summary())  # shown with -s
    if where:
        write_json(Path(where) / f"{name}.json", run.summary())
        write_json(Path(where) / f"{name}_exchanges.json", [e.__dict__ for e in run.exchanges])


def _check(run: AgentRun) -> None:
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-2000:])
    assert any(t.tool_calls for t in run.turns), f"no tool call in {[t.__dict__ for t in run.turns]}"
    assert sent_tool_result(run.exchanges), "the tool's result never came back to the server"
    assert all(t.status == 200 for t in run.turns if t.tool_calls)


def test_claude_code_completes(server: RunningServer, tmp_path: Path) -> None:
    work = _workdir(tmp_path)
    model = server.model
    with recording_proxy(server.base_url) as (url, recorder):
        env = {
            "HOME": str(tmp_path / "home"),
            "ANTHROPIC_BASE_URL": url,
            "ANTHROPIC_API_KEY": "unused",
            "ANTHROPIC_MODEL": model,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
            "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
            "CLAUDE_STREAM_IDLE_TIMEOUT_MS": IDLE_MS,
            "API_TIMEOUT_MS": IDLE_MS,
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "256",  # a 135M model rambles; keep each turn short
        }
        cmd = [
            str(AGENTS_BIN / "claude"),
            "-p",
            TASK,
            "--tools",
            "Read",
            "--allowedTools",
            "Read",
            "--output-format",
            "json",
            "--max-turns",
            "4",
        ]
        code, out, err, wall = run_agent(cmd, work, env, AGENT_TIMEOUT)
    exchanges = [e for e in recorder.exchanges if e.path.startswith("/v1/messages") and "count_tokens" not in e.path]
    run = AgentRun(code, out, err, wall, [messages_turn(e) for e in exchanges], exchanges)
    _record("claude_code", run)
    _check(run)


def test_codex_completes(server: RunningServer, tmp_path: Path) -> None:
    work = _workdir(tmp_path)
    home = tmp_path / "codex"
    home.mkdir()
    with recording_proxy(server.base_url) as (url, recorder):
        (home / "config.toml").write_text(
            f'model = "{server.model}"\nmodel_provider = "metalserve"\n'
            'web_search = "disabled"  # a hosted tool: refused by the server (docs/agents.md)\n\n'
            "[model_providers.metalserve]\n"
            f'name = "metalserve"\nbase_url = "{url}/v1"\nwire_api = "responses"\n'
            f"stream_idle_timeout_ms = {IDLE_MS}\nrequest_max_retries = 0\nstream_max_retries = 0\n"
        )
        env = {"CODEX_HOME": str(home), "HOME": str(tmp_path)}
        cmd = [
            str(AGENTS_BIN / "codex"),
            "exec",
            "--skip-git-repo-check",
            "--dangerously-bypass-approvals-and-sandbox",
            TASK,
        ]
        code, out, err, wall = run_agent(cmd, work, env, AGENT_TIMEOUT)
    exchanges = [e for e in recorder.exchanges if e.path.startswith("/v1/responses")]
    run = AgentRun(code, out, err, wall, [responses_turn(e) for e in exchanges], exchanges)
    _record("codex", run)
    _check(run)
