"""Start pipeline servers as subprocesses (each under a timeout), the local way or the mlx.launch way."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO

import httpx

from tests.e2e.server import free_port


def serve_cmd(model: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "metalserve.cli", "serve", str(model), "--log-stats-interval", "0", *flags]


@contextmanager
def local_pipeline(
    model: Path, size: int, *flags: str, timeout: float = 120
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`metalserve serve --pipeline-parallel-size N` (it starts its own ranks); yields (process, base url)."""
    port = free_port()
    cmd = serve_cmd(model, "--port", str(port), "--pipeline-parallel-size", str(size), *flags)
    with tempfile.TemporaryFile("w+") as log:  # a file, not a pipe: a full pipe would block the server
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(proc, base, timeout, log)
            yield proc, base
        finally:
            stop_group(proc)


def wait_healthy(proc: subprocess.Popen[str], base: str, timeout: float, log: IO[str]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"the server exited with {proc.returncode}: {proc.stderr.read()[-2000:] if proc.stderr else ''}"
            )
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError("the pipeline server did not become healthy in time")


def stop_group(proc: subprocess.Popen[str]) -> None:
    """End the server and every rank it started (they share its session)."""
    if proc.poll() is None:
        proc.terminate()
        with suppress(subprocess.TimeoutExpired):
            proc.wait(20)
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(5)


def child_pids(pid: int) -> list[int]:
    """The process's children, whichever of its threads started them (the engine thread starts the ranks)."""
    tasks = sorted(Path(f"/proc/{pid}/task").iterdir(), key=lambda task: int(task.name))
    return sorted(int(child) for task in tasks for child in (task / "children").read_text().split())


def launched_ranks(
    models: list[Path], tmp_path: Path, timeout: float = 120, flag: str = "--pipeline-parallel-size"
) -> list[subprocess.CompletedProcess[str]]:
    """Run one `metalserve serve` per rank with MLX_RANK and MLX_HOSTFILE set, as mlx.launch does across
    hosts; each rank may get a different model path; `flag` sets the group's size. Returns every rank's
    finished process."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in models]))
    procs = []
    for rank, model in enumerate(models):
        env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
        flags = ["--port", str(free_port()), flag, str(len(models))]
        procs.append(
            subprocess.Popen(
                serve_cmd(model, *flags), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    done = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, ""))
    return done
