"""The KV disk tier against recompute, on real `metalserve serve` processes and the default model.

Arm "restart": an agent-like conversation (a long system prompt and 5 turns, the history resent each
turn) on a server with --kv-disk-dir; the server is stopped and started again on the same directory; a
sixth turn is timed (TTFT) against the same turn on a fresh server without the disk tier.

Arm "pressure": a KV pool too small for two conversations, alternating between them (X1 Y1 X2 Y2),
with and without the disk tier: the TTFT of a returning conversation (its second turn on).

Greedy decoding throughout: every arm must produce the same texts (checked; a mismatch is reported).

    python bench/disk_tier.py                      # the default model, ~3,700-token system prompt
    python bench/disk_tier.py --system-chars 4000  # a quicker, smaller run
    python bench/disk_tier.py --server-flags=--async-scheduling  # every server with async scheduling
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from statistics import mean
from typing import Any

import httpx

SONNETS = Path(__file__).resolve().parents[2] / "shared" / "data" / "sonnet.txt"
Message = dict[str, str]
MODEL = "default"  # the served model's name, read from /v1/models when a server starts
SERVER_FLAGS: list[str] = []  # --server-flags: given to every server of every arm


def system_prompt(chars: int, offset: int = 0) -> str:
    """An agent-like system prompt: instructions and a reference text of about `chars` characters."""
    text = SONNETS.read_text() if SONNETS.exists() else " ".join(f"rule {i}: keep answers short." for i in range(9999))
    body = (text * 4)[offset : offset + chars]
    return "You are a careful assistant. Answer using the reference text below.\n\n" + body


def turns(n: int) -> list[str]:
    return [f"Question {i + 1}: which line of the reference speaks of time or beauty? Quote it." for i in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def server(flags: list[str], log: Path) -> Iterator[str]:
    """`metalserve serve` on a free port until the block ends (SIGTERM: a graceful stop)."""
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
        *SERVER_FLAGS,
        *flags,
    ]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 900
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited with {proc.returncode}; see {log}")
                try:
                    if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError("the server did not start")
                time.sleep(0.5)
            global MODEL
            MODEL = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
            chat(base, [{"role": "user", "content": "Hi"}], 1)  # warm-up, shares no prefix with the runs
            yield base
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()


def chat(base: str, messages: list[Message], max_tokens: int) -> tuple[float, str, int]:
    """Stream one greedy chat completion: (TTFT seconds, text, prompt tokens)."""
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    ttft, parts, prompt_tokens = None, [], 0
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=900) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk: dict[str, Any] = json.loads(line[6:])
            if chunk.get("usage"):
                prompt_tokens = chunk["usage"]["prompt_tokens"]
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {}).get("content")
                if delta:
                    ttft = ttft if ttft is not None else time.perf_counter() - started
                    parts.append(delta)
    return (ttft if ttft is not None else time.perf_counter() - started), "".join(parts), prompt_tokens


def conversation_turn(base: str, history: list[Message], question: str, out: int) -> tuple[float, str, int]:
    """Send the history plus `question`; append both sides to `history`."""
    history.append({"role": "user", "content": question})
    ttft, text, prompt_tokens = chat(base, history, out)
    history.append({"role": "assistant", "content": text})
    return ttft, text, prompt_tokens


def arm_restart(args: argparse.Namespace, work: Path, log: Path) -> dict[str, Any]:
    history: list[Message] = [{"role": "system", "content": system_prompt(args.system_chars)}]
    questions = turns(6)
    disk = ["--kv-disk-dir", str(work / "restart")]
    earlier = []
    with server(disk, log) as base:
        for q in questions[:5]:
            earlier.append(conversation_turn(base, history, q, args.output_tokens))
    sixth = [*history, {"role": "user", "content": questions[5]}]
    with server(disk, log) as base:  # restarted on the same directory
        warm = chat(base, sixth, args.output_tokens)
    with server([], log) as base:  # no disk tier: the sixth turn recomputes everything
        cold = chat(base, sixth, args.output_tokens)
    return {
        "turn_ttft_s": [round(t, 3) for t, _, _ in earlier],
        "sixth_prompt_tokens": warm[2],
        "sixth_ttft_disk_s": round(warm[0], 3),
        "sixth_ttft_recompute_s": round(cold[0], 3),
        "ratio": round(warm[0] / cold[0], 3),
        "texts_equal": warm[1] == cold[1],
    }


def alternate(base: str, rounds: int, chars: int, out: int) -> list[tuple[str, int, float, str, int]]:
    """X1 Y1 X2 Y2 ...: (conversation, turn, TTFT, text, prompt tokens) per request."""
    histories = {
        name: [{"role": "system", "content": system_prompt(chars, offset)}] for name, offset in (("X", 0), ("Y", chars))
    }
    results = []
    for k, question in enumerate(turns(rounds)):
        for name, history in histories.items():
            ttft, text, prompt_tokens = conversation_turn(base, history, question, out)
            results.append((name, k + 1, ttft, text, prompt_tokens))
    return results


def arm_pressure(args: argparse.Namespace, work: Path, log: Path) -> dict[str, Any]:
    small = ["--kv-cache-memory", str(args.pressure_kv_bytes), "--max-model-len", str(args.pressure_max_model_len)]
    with server([*small, "--kv-disk-dir", str(work / "pressure")], log) as base:
        disk = alternate(base, args.rounds, args.pressure_system_chars, args.output_tokens)
    with server(small, log) as base:
        ram = alternate(base, args.rounds, args.pressure_system_chars, args.output_tokens)
    returning_disk = [r[2] for r in disk if r[1] > 1]
    returning_ram = [r[2] for r in ram if r[1] > 1]
    return {
        "requests": [
            {
                "conv": d[0],
                "turn": d[1],
                "prompt_tokens": d[4],
                "ttft_disk_s": round(d[2], 3),
                "ttft_recompute_s": round(r[2], 3),
            }
            for d, r in zip(disk, ram, strict=True)
        ],
        "returning_ttft_disk_s": round(mean(returning_disk), 3),
        "returning_ttft_recompute_s": round(mean(returning_ram), 3),
        "ratio": round(mean(returning_disk) / mean(returning_ram), 3),
        "texts_equal": [d[3] for d in disk] == [r[3] for r in ram],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system-chars", type=int, default=12000, help="system prompt characters (~3,000 tokens)")
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="turns per conversation in the pressure arm")
    # The default model keeps fp32 K/V: 30 layers x 2 x 3 heads x 64 x 4 B = 46,080 B per token. 200 MB hold
    # about 4,300 tokens: one conversation of the pressure arm, not two.
    parser.add_argument("--pressure-kv-bytes", type=int, default=200_000_000)
    parser.add_argument("--pressure-max-model-len", type=int, default=4096)
    # ~2,500 tokens: a conversation of a few turns stays within --pressure-max-model-len.
    parser.add_argument("--pressure-system-chars", type=int, default=8000)
    parser.add_argument("--arms", default="restart,pressure")
    parser.add_argument("--json", default=None, help="write the results here too")
    parser.add_argument(
        "--server-flags", default="", help="more flags for every server, e.g. --server-flags=--async-scheduling"
    )
    args = parser.parse_args()
    SERVER_FLAGS.extend(args.server_flags.split())
    work = Path(tempfile.mkdtemp(prefix="disk_tier_"))
    log = work / "servers.log"
    print(f"work directory {work} (server logs: {log})", flush=True)
    results: dict[str, Any] = {}
    try:
        if "restart" in args.arms:
            results["restart"] = arm_restart(args, work, log)
            print(json.dumps(results["restart"], indent=1), flush=True)
        if "pressure" in args.arms:
            results["pressure"] = arm_pressure(args, work, log)
            print(json.dumps(results["pressure"], indent=1), flush=True)
    finally:
        if not os.environ.get("KEEP_DISK_TIER_WORK"):
            shutil.rmtree(work / "restart", ignore_errors=True)
            shutil.rmtree(work / "pressure", ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print("\n| arm | disk tier TTFT s | recompute TTFT s | ratio | target | texts equal |")
    print("|---|---|---|---|---|---|")
    if "restart" in results:
        r = results["restart"]
        print(
            f"| 6th turn after a restart ({r['sixth_prompt_tokens']} prompt tokens) | {r['sixth_ttft_disk_s']} | "
            f"{r['sixth_ttft_recompute_s']} | {r['ratio']} | <= 0.3 | {r['texts_equal']} |"
        )
    if "pressure" in results:
        p = results["pressure"]
        print(
            f"| returning conversation, pool for one | {p['returning_ttft_disk_s']} | "
            f"{p['returning_ttft_recompute_s']} | {p['ratio']} | <= 0.4 | {p['texts_equal']} |"
        )


if __name__ == "__main__":
    main()
