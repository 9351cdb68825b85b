"""Start the real `metalserve serve` in a subprocess on a free local port, for end-to-end tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx


@dataclass
class RunningServer:
    base_url: str  # http://127.0.0.1:PORT
    model: str
    process: subprocess.Popen[bytes]

    @property
    def v1(self) -> str:
        return f"{self.base_url}/v1"

    def metric(self, name: str) -> float:
        """One sample of a Prometheus metric, summed over its label sets."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=30).text
        values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")]
        if not values:
            raise KeyError(f"no metric {name} in /metrics")
        return sum(values)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def running_server(*flags: str, startup_timeout: float = 600.0) -> Iterator[RunningServer]:
    port = free_port()
    log = open(os.devnull, "wb") if not os.environ.get("METALSERVE_TEST_SERVER_LOG") else None  # noqa: SIM115
    cmd = [sys.executable, "-m", "metalserve.cli", "serve", "--port", str(port), "--log-stats-interval", "0", *flags]
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT if log else None)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with {process.returncode} before it was ready")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the server did not become healthy in time")
            time.sleep(0.5)
        model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
        yield RunningServer(base, model, process)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        if log:
            log.close()
