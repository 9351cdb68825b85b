"""Two models behind one server: the embedded default and a tiny random-weight one. Prints the server's
resident memory at start (nothing loaded), after both loaded, and after the default model, left idle
while the tiny one stays in use, was unloaded; with each model's measured size. Run by hand:
    .venv/bin/python bench/multi_model_memory.py [--idle-timeout 5]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.startup import free_port, rss_mib  # noqa: E402
from tests.loader.tiny_models import write_mlx_dir  # noqa: E402


def chat(base: str, model: str) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 16,
        "temperature": 0,
    }
    response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=600)
    response.raise_for_status()
    print(f"  {model}: {response.json()['choices'][0]['message']['content']!r}")


def report(label: str, base: str, pid: int) -> None:
    status = httpx.get(f"{base}/v1/server/status", timeout=30).json()
    sizes = ", ".join(
        f"{m['id']} {m['state']}" + (f" {m['memory_bytes'] / 2**20:.1f} MiB" if m["state"] == "loaded" else "")
        for m in status["models"]
    )
    print(
        f"{label:<28} RSS {rss_mib(pid):8.1f} MiB   budget held {status['memory']['models_bytes'] / 2**20:7.1f} MiB"
        f"   ({sizes})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--idle-timeout", type=float, default=10.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tiny = write_mlx_dir(Path(tmp) / "tiny", "llama")
        models = [{"name": "smollm2", "kv_cache_memory": 512 * 2**20}, {"model": str(tiny), "name": "tiny"}]
        (Path(tmp) / "models.json").write_text(json.dumps(models))
        port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "metalserve.cli",
            "serve",
            "--port",
            str(port),
            "--log-stats-interval",
            "0",
            "--models",
            str(Path(tmp) / "models.json"),
            "--model-idle-timeout",
            str(args.idle_timeout),
        ]
        print("$", " ".join(cmd))
        server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        try:
            while True:
                try:
                    if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.5)
            report("at start", base, server.pid)
            chat(base, "smollm2")
            chat(base, "tiny")
            report("both loaded", base, server.pid)
            while "unloaded" not in json.dumps(httpx.get(f"{base}/v1/models", timeout=30).json()):
                chat(base, "tiny")  # tiny stays in use while smollm2 goes idle
                time.sleep(0.5)
            report("after the idle one unloaded", base, server.pid)
        finally:
            server.terminate()
            server.wait(timeout=60)


if __name__ == "__main__":
    main()
