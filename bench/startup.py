"""Start-up of the default server: seconds from launch to a healthy /health, and resident memory then and
after one request. Versions are compared side by side by pointing --code at other checkouts (their
package is imported through PYTHONPATH with this venv's Python), alternating runs. Run by hand:
    .venv/bin/python bench/startup.py [--code . --code ../other-checkout] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16}


def rss_mib(pid: int) -> float:
    """Resident memory of a process: /proc on Linux, ps elsewhere (macOS)."""
    status = Path(f"/proc/{pid}/status")
    if status.exists():
        line = next(ln for ln in status.read_text().splitlines() if ln.startswith("VmRSS:"))
        return int(line.split()[1]) / 1024
    return int(subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True).stdout) / 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(code: Path, extra: list[str]) -> tuple[float, float, float, int]:
    """(seconds to healthy, RSS MiB when healthy, RSS MiB after a chat request, exit status on SIGTERM)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(code)}
    cmd = [
        sys.executable,
        "-c",
        "from metalserve.cli import main; main()",
        "serve",
        "--port",
        str(port),
        "--log-stats-interval",
        "0",
        *extra,
    ]
    start = time.monotonic()
    # cwd too: `python -c` puts the working directory first on sys.path.
    proc = subprocess.Popen(cmd, env=env, cwd=code, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{code}: the server exited with {proc.returncode}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        healthy = time.monotonic() - start
        rss = rss_mib(proc.pid)
        httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=120).raise_for_status()
        rss_after = rss_mib(proc.pid)
        proc.terminate()
        return healthy, rss, rss_after, proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code", action="append", type=Path, help="a checkout to run (repeatable; default .)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("serve_args", nargs="*", help="flags for metalserve serve (after --)")
    args = parser.parse_args()
    codes = [c.resolve() for c in (args.code or [Path(".")])]
    print(f"{'checkout':40} {'healthy s':>10} {'RSS MiB':>9} {'after 1 req':>12} {'exit':>5}")
    for _ in range(args.repeats):
        for code in codes:
            healthy, rss, after, status = measure(code, args.serve_args)
            print(f"{str(code):40} {healthy:10.1f} {rss:9.0f} {after:12.0f} {status:5d}", flush=True)


if __name__ == "__main__":
    main()
