"""The serve flags, their mapping onto the configs, the stats log line, and shutdown on SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from metalserve.api.metrics import StatLogState
from metalserve.api.served_models import single_model_spec
from metalserve.api.server import add_cli_args, config_from_args, default_token_budget
from metalserve.config import ConfigError
from metalserve.engine.async_engine import IterationStats
from metalserve.platform import current_platform
from tests.api.conftest import _free_port
from tests.api.fakes import FakeStats

ROOT = Path(__file__).resolve().parents[2]


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return parser.parse_args(list(argv))


def test_flags_map_onto_configs(tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0].content }}")
    args = _parse(
        "model.gguf",
        "--host",
        "0.0.0.0",
        "--port",
        "9001",
        "--api-key",
        "k",
        "--served-model-name",
        "m",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "256",
        "--no-enable-prefix-caching",
        "--scheduling-policy",
        "priority",
        "--block-size",
        "32",
        "--chat-template",
        str(template),
        "--tool-call-parser",
        "llama3_json",
    )
    config, settings = config_from_args(args)
    assert (config.model, config.max_model_len, config.max_num_seqs, config.max_num_batched_tokens) == (
        "model.gguf",
        512,
        4,
        256,
    )
    assert not config.enable_prefix_caching and config.scheduling_policy == "priority" and config.block_size == 32
    assert config.chat_template == "{{ messages[0].content }}" and config.tool_call_parser == "llama3_json"
    assert (settings.host, settings.port, settings.api_key, settings.served_model_name) == (
        "0.0.0.0",
        9001,
        "k",
        (("m",),),
    )
    assert single_model_spec(config, settings).names == ("m",)
    defaults, default_settings = config_from_args(_parse())
    assert defaults.model is None and defaults.enable_prefix_caching
    assert defaults.max_num_batched_tokens == default_token_budget()
    assert default_token_budget() == (512 if current_platform().on_cpu else 2048)
    # The embedded default's id, as README.md shows it.
    assert single_model_spec(defaults, default_settings).names == ("SmolLM2-135M-Instruct.Q4_1",)


def test_async_scheduling_defaults_to_the_platform_and_can_be_set_either_way() -> None:
    assert config_from_args(_parse())[0].async_scheduling is None  # on with Metal, off on the CPU backend
    assert config_from_args(_parse("--no-async-scheduling"))[0].async_scheduling is False
    assert config_from_args(_parse("--async-scheduling"))[0].async_scheduling is True


def test_bad_flags_are_clear_errors() -> None:
    with pytest.raises(ConfigError, match="--max-num-seqs"):
        config_from_args(_parse("--max-num-seqs", "0"))
    with pytest.raises(ValueError, match="--chat-template"):
        config_from_args(_parse("--chat-template", "no-such-file.jinja"))
    with pytest.raises(SystemExit):
        _parse("--tool-call-parser", "nope")
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs a tool-call parser"):
        config_from_args(_parse("--enable-auto-tool-choice", "--tool-call-parser", "none"))
    # Without --tool-call-parser the parser is read off the chat template at load (test_parser_detection.py).
    assert config_from_args(_parse("--enable-auto-tool-choice"))[1].tool_call_parser is None
    config, settings = config_from_args(_parse("--enable-auto-tool-choice", "--tool-call-parser", "hermes"))
    assert settings.tool_call_parser == "hermes"


def test_stats_log_line() -> None:
    state = StatLogState()
    stats = FakeStats(2, 1, 0.25, 100, 40, 0, 30, 40)
    state.record(stats, IterationStats(num_prompt_tokens=50, num_generation_tokens=10))
    line = state.line()
    assert "Running: 2 reqs, Waiting: 1 reqs" in line
    assert "GPU KV cache usage: 25.0%" in line and "Prefix cache hit rate: 40.0%" in line
    assert "Avg prompt throughput: 0.0" not in line  # 50 tokens in a few microseconds
    assert "Avg generation throughput: 0.0 tokens/s" in state.line()  # counts reset after a line


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_shuts_down_cleanly(sig: signal.Signals) -> None:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.api.serve_fake", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline and proc.poll() is None, "server did not start"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        ok = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "say:hi"}, timeout=10)
        assert ok.json()["choices"][0]["text"] == "hi"
        time.sleep(0.5)  # let a stats line appear
        proc.send_signal(sig)
        output, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output  # a signal asks for this stop: an orderly end
    assert "Application shutdown complete" in output and "Traceback" not in output
    assert "Avg generation throughput" in output
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
