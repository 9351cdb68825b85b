"""Does `metalserve bench serve` measure what `vllm bench serve` measures? Same server, same workload.

Runs our client, then vLLM's (from a separate venv: `pip install --no-deps vllm` plus aiohttp, transformers,
tqdm, numpy, pandas, datasets, pillow), and compares mean TTFT, TPOT, ITL, E2EL and output throughput.
Against a running server (--base-url) or the tests' fake server with fixed delays (--fake):
    .venv/bin/python bench/peers/client_agreement.py --fake
    .venv/bin/python bench/peers/client_agreement.py --base-url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from peers.bench_run import RESULTS, run_bench  # noqa: E402
from peers.launch import MLX_DIR, PEERS  # noqa: E402

OUT = RESULTS / "client_agreement"
KEYS = (
    ("ttft_ms", "mean_ttft_ms"),
    ("tpot_ms", "mean_tpot_ms"),
    ("itl_ms", "mean_itl_ms"),
    ("e2el_ms", "mean_e2el_ms"),
)


def ours(url: str, a: argparse.Namespace) -> dict[str, float]:
    args = [
        "--endpoint",
        "completions",
        "--tokenizer",
        a.tokenizer,
        "--input-len",
        str(a.input_len),
        "--output-len",
        str(a.output_len),
        "--num-prompts",
        str(a.num_prompts),
        "--max-concurrency",
        str(a.concurrency),
        "--ignore-eos",
        "--seed",
        str(a.seed),
        "--disable-tqdm",
    ]
    if a.model:
        args += ["--model", a.model]
    m = run_bench(url, OUT / "ours.json", args, {})["metrics"]
    return {k2: m[k1]["mean"] for k1, k2 in KEYS} | {"output_throughput": m["output_throughput"]}


def vllms(url: str, model: str, a: argparse.Namespace) -> dict[str, float]:
    cmd = [
        a.vllm,
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        url,
        "--endpoint",
        "/v1/completions",
        "--model",
        model,
        "--tokenizer",
        a.tokenizer,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(a.input_len),
        "--random-output-len",
        str(a.output_len),
        "--num-prompts",
        str(a.num_prompts),
        "--max-concurrency",
        str(a.concurrency),
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        str(a.seed),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--save-result",
        "--result-dir",
        str(OUT),
        "--result-filename",
        "vllm.json",
    ]
    subprocess.run(cmd, check=True)
    doc: dict[str, Any] = json.loads((OUT / "vllm.json").read_text(encoding="utf-8"))
    return {k: float(doc[k]) for _, k in KEYS} | {"output_throughput": float(doc["output_throughput"])}


def _server(a: argparse.Namespace) -> AbstractContextManager[Any]:
    if not a.fake:
        return nullcontext(None)
    from tests.benchmarks.fake_server import FakeBehaviour, FakeServer

    return FakeServer(FakeBehaviour(ttft_s=0.2, itl_s=0.02))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None)
    p.add_argument("--fake", action="store_true", help="the fake server: TTFT 200 ms, ITL 20 ms")
    p.add_argument("--model", default=None)
    p.add_argument("--tokenizer", default=str(MLX_DIR))
    p.add_argument("--vllm", default=str(PEERS / "vllm-venv" / "bin" / "vllm"))
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if not a.fake and not a.base_url:
        p.error("give --base-url or --fake")
    OUT.mkdir(parents=True, exist_ok=True)
    with _server(a) as fake:
        url = fake.url if fake else a.base_url
        if fake:
            a.model = a.model or "fake-model"
        mine = ours(url, a)
        model = a.model or json.loads((OUT / "ours.json").read_text(encoding="utf-8"))["settings"]["model"]
        theirs = vllms(url, model, a)
    lines = ["| metric | metalserve bench | vllm bench | ratio | within 10 % |", "|---|---|---|---|---|"]
    worst = 0.0
    for key, value in mine.items():
        ratio = value / theirs[key] if theirs[key] else float("nan")
        worst = max(worst, abs(ratio - 1))
        lines.append(f"| {key} | {value:.2f} | {theirs[key]:.2f} | {ratio:.3f} | {abs(ratio - 1) <= 0.10} |")
    md = "\n".join(lines) + "\n"
    (OUT / "client_agreement.md").write_text(md, encoding="utf-8")
    print(md)
    return 0 if worst <= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
