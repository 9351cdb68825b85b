"""The README's multi-host form on one machine: `mlx.launch --backend ring -n 2 -- metalserve serve ...`
runs `metalserve serve` as every rank; rank 0 serves HTTP with the same greedy text as the local form."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from tests.distributed.procs import local_pipeline, wait_healthy
from tests.e2e.server import free_port

BODY = {"prompt": "he said the thing", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def _complete(base: str) -> str:
    model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
    reply = httpx.post(f"{base}/v1/completions", json={**BODY, "model": model}, timeout=60).json()
    text: str = reply["choices"][0]["text"]
    return text


@pytest.mark.slow
def test_mlx_launch_runs_every_rank(tiny_llama: Path) -> None:
    launcher = Path(sys.executable).parent / "mlx.launch"
    port = free_port()
    cmd = [str(launcher), "--backend", "ring", "-n", "2", "--starting-port", str(free_port()),
           "--python", sys.executable, "--", "-m", "metalserve.cli", "serve", str(tiny_llama),
           "--pipeline-parallel-size", "2", "--port", str(port), "--log-stats-interval", "0"]  # fmt: skip
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            wait_healthy(proc, f"http://127.0.0.1:{port}", 120, log)  # type: ignore[arg-type]
            launched = _complete(f"http://127.0.0.1:{port}")
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    with local_pipeline(tiny_llama, 2) as (_, base):
        assert _complete(base) == launched
