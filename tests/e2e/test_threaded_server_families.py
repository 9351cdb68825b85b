"""Every architecture through the real threaded server, over HTTP: one short request and one batched
request, greedy tokens equal to mlx-lm's own generation.

The server loads the model and steps it on its engine thread (`build_registry`, as `metalserve serve`);
before that was so, gemma4_text (whose RoPE table stays lazy after loading) failed its first request
there (the core now refuses a step on any other thread than the one that built it). A small
`--kv-cache-memory` keeps the warm-up step short, as a user's flag would. The matrix runs the server in
this process (the same start-up, app and uvicorn, without the interpreter's start each time); one test
runs `metalserve serve` itself. The default run serves one architecture per family; the rest of the
project's matrix is `slow`."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from metalserve.api.app import build_app
from metalserve.api.frontend import Frontend
from metalserve.api.served_models import build_registry
from metalserve.api.settings import ServerSettings
from metalserve.config import EngineConfig
from tests.e2e.family_dirs import FAMILIES, MATRIX, VOCAB, mlx_lm_model, write_model_dir
from tests.e2e.server import free_port, running_server
from tests.models import golden

NEW_TOKENS = 8
KV_BYTES, BUDGET, SEQS = 1 << 24, 64, 4  # a budget of 64 tokens chunks the 90-token prompt


def _matrix() -> list[Any]:
    default = set(FAMILIES.values())
    return [a if a in default else pytest.param(a, marks=pytest.mark.slow) for a in MATRIX]


@contextmanager
def _serving(path: Path) -> Iterator[str]:
    """`metalserve serve PATH` in this process: its start-up (engine thread), app and uvicorn; the base URL."""
    config = EngineConfig(model=str(path), kv_cache_memory=KV_BYTES, max_num_batched_tokens=BUDGET, max_num_seqs=SEQS)
    port = free_port()
    settings = ServerSettings(port=port, log_stats_interval=0)
    frontend = Frontend.of(settings)
    app = build_app(build_registry(config, settings, frontend), frontend)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _complete(v1: str, prompt: list[int] | list[list[int]]) -> list[golden.Generation]:
    body = {
        "prompt": prompt,
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }
    response = httpx.post(f"{v1}/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    out = []
    for choice in sorted(response.json()["choices"], key=lambda c: c["index"]):
        tokens = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
        out.append(golden.Generation(tokens, choice["logprobs"]["token_logprobs"]))
    return out


def _short_and_batched(v1: str, path: Path) -> None:
    short, first, second = golden.prompts([golden.SHORT, 40, 90], VOCAB, seed=3)
    model = mlx_lm_model(path)
    want = [golden.reference(model, p, NEW_TOKENS) for p in (short, first, second)]
    (alone,) = _complete(v1, short)
    batched = _complete(v1, [first, second])  # one request, two prompts stepped together
    for got, expected in zip([alone, *batched], want, strict=True):
        golden.check(got, expected)


@pytest.mark.parametrize("arch", _matrix())
def test_short_and_batched_requests_equal_mlx_lm(tmp_path: Path, arch: str) -> None:
    path = write_model_dir(tmp_path / "model", arch)
    with _serving(path) as v1:
        _short_and_batched(v1, path)


def test_metalserve_serve_runs_a_gemma4_directory(tmp_path: Path) -> None:
    """The report's own steps: `metalserve serve DIR` in a subprocess, the first requests answered."""
    path = write_model_dir(tmp_path / "model", "gemma4_text")
    flags = ("--kv-cache-memory", str(KV_BYTES), "--max-num-batched-tokens", str(BUDGET), "--max-num-seqs", str(SEQS))
    with running_server(str(path), *flags) as server:
        _short_and_batched(server.v1, path)
        assert server.process.poll() is None  # still serving
