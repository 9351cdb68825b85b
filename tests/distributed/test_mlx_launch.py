"""The README's multi-host form on one machine: `mlx.launch --backend ring -n 2 -- metalserve serve ...`
runs `metalserve serve` as every rank and rank 0 serves HTTP (the tokens themselves are checked against
one process in test_pipeline_tokens.py, through the same code)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from tests.distributed.procs import wait_healthy
from tests.e2e.server import free_port

BODY = {"prompt": "he said the thing", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def _completion_tokens(base: str) -> int:
    model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
    reply = httpx.post(f"{base}/v1/completions", json={**BODY, "model": model}, timeout=60).json()
    n: int = reply["usage"]["completion_tokens"]
    return n


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flag", "ready"),
    [
        ("--pipeline-parallel-size", "pipeline rank 1 ready: layers 2-3"),
        ("--tensor-parallel-size", "tensor-parallel rank 1 ready"),
    ],
)
def test_mlx_launch_runs_every_rank(tiny_llama: Path, flag: str, ready: str) -> None:
    launcher = Path(sys.executable).parent / "mlx.launch"
    port = free_port()
    cmd = [
        str(launcher),
        "--backend",
        "ring",
        "-n",
        "2",
        "--starting-port",
        str(free_port()),
        "--python",
        sys.executable,
        "--",
        "-m",
        "metalserve.cli",
        "serve",
        str(tiny_llama),
        flag,
        "2",
        "--port",
        str(port),
        "--log-stats-interval",
        "0",
    ]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            wait_healthy(proc, f"http://127.0.0.1:{port}", 120, log)  # type: ignore[arg-type]
            assert _completion_tokens(f"http://127.0.0.1:{port}") == 8
            log.seek(0)
            text = log.read()
            assert ready in text and "serving on http" in text
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
