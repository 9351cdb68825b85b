"""The README's multi-host form on one machine: `mlx.launch --backend ring -n N -- metalserve serve ...`
runs `metalserve serve` as every rank and rank 0 serves HTTP. At 2 ranks the tokens themselves are
checked against one process in test_pipeline_tokens.py (same code); at 4 ranks (PP 4, TP 2 x PP 2) the
greedy completions are compared with a one-process server here."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from tests.distributed.procs import wait_healthy
from tests.e2e.server import free_port, running_server

BODY = {"prompt": "he said the thing", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def _free_run(n: int) -> int:
    """A port P with P..P+n-1 all free: mlx.launch's ring listens on `--starting-port` + rank, and a
    single free port says nothing about its neighbours."""
    for _ in range(50):
        start = free_port()
        try:
            for port in range(start, start + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return start
    raise RuntimeError(f"no {n} consecutive free ports")


def _launch_cmd(model: Path, n: int, port: int, *flags: str) -> list[str]:
    launcher = Path(sys.executable).parent / "mlx.launch"
    ring = _free_run(n)
    while ring <= port < ring + n:
        ring = _free_run(n)
    return [
        str(launcher),
        "--backend",
        "ring",
        "-n",
        str(n),
        "--starting-port",
        str(ring),
        "--python",
        sys.executable,
        "--",
        "-m",
        "metalserve.cli",
        "serve",
        str(model),
        *flags,
        "--port",
        str(port),
        "--log-stats-interval",
        "0",
    ]


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
    port = free_port()
    cmd = _launch_cmd(tiny_llama, 2, port, flag, "2")
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


PROMPTS = ["he said the thing", "a longer prompt about the river and the town beyond it", "once"]


def _greedy_texts(base: str, timeout: float) -> list[str]:
    model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
    texts = []
    for prompt in PROMPTS:
        body = {**BODY, "model": model, "prompt": prompt, "max_tokens": 12}
        reply = httpx.post(f"{base}/v1/completions", json=body, timeout=timeout).json()
        texts.append(reply["choices"][0]["text"])
    return texts


@pytest.mark.slow  # 4 ranks + a one-process server: ~60-120 s on a loaded 2-core machine
@pytest.mark.parametrize(
    ("flags", "ready"),
    [
        (("--pipeline-parallel-size", "4"), "pipeline rank 3 ready: layers 3-3"),
        (("--pipeline-parallel-size", "2", "--tensor-parallel-size", "2"), "pipeline rank 3 ready: layers 2-3"),
    ],
)
def test_mlx_launch_four_ranks_match_one_process(tiny_llama: Path, flags: tuple[str, ...], ready: str) -> None:
    with running_server(str(tiny_llama), startup_timeout=180) as one:
        expected = _greedy_texts(one.base_url, 120)
    port = free_port()
    cmd = _launch_cmd(tiny_llama, 4, port, *flags)
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            wait_healthy(proc, f"http://127.0.0.1:{port}", 180, log)  # type: ignore[arg-type]
            got = _greedy_texts(f"http://127.0.0.1:{port}", 300)
            log.seek(0)
            text = log.read()
            assert ready in text and "serving on http" in text
            assert got == expected
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
