"""Prefix caching on a multi-turn agent workload: TTFT per turn with caching on and off, and the hit rate.

Conversations share a long system prompt and grow by turns (each turn re-sends the whole history), so a
prefix cache should make later turns' TTFT nearly independent of the history. A fresh metalserve per mode,
the same prompts for both. Run by hand:
    .venv/bin/python bench/prefix_cache.py [--turns 6] [--system-len 1024] [--conversations 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

import httpx
from peers.bench_run import RESULTS, run_bench
from peers.launch import RunningServer
from peers.servers import spec_for

OUT = RESULTS / "prefix_cache"
HITS, QUERIES = "vllm:prefix_cache_hits", "vllm:prefix_cache_queries"


def scrape(base_url: str) -> dict[str, float]:
    return parse_prometheus(httpx.get(base_url + "/metrics", timeout=30).text)


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text format: each metric summed over its labels, keyed without `_total`."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0].removesuffix("_total")
        try:
            totals[name] = totals.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return totals


def ttft_by_turn(doc: dict[str, Any]) -> list[float]:
    """Mean TTFT in seconds of each turn index over the conversations (successful requests only)."""
    turns: dict[int, list[float]] = {}
    for r in doc["requests"]:
        if r["success"]:
            turns.setdefault(r["turn"], []).append(r["ttft_s"])
    return [statistics.fmean(turns[t]) for t in sorted(turns)]


def run_mode(caching: bool, a: argparse.Namespace) -> dict[str, Any]:
    flags = [] if caching else ["--no-enable-prefix-caching"]
    name = "on" if caching else "off"
    args = [
        "--endpoint",
        "chat",
        "--dataset-name",
        "agent",
        "--agent-turns",
        str(a.turns),
        "--agent-system-len",
        str(a.system_len),
        "--input-len",
        str(a.turn_len),
        "--output-len",
        str(a.output_len),
        "--num-prompts",
        str(a.conversations),
        "--max-concurrency",
        str(a.concurrency),
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        str(a.seed),
        "--num-warmups",
        "1",
        "--disable-tqdm",
    ]
    with RunningServer(spec_for("metalserve", a.concurrency, flags), OUT / f"metalserve-{name}.log") as srv:
        before = scrape(srv.base_url)
        doc = run_bench(srv.base_url, OUT / f"caching-{name}.json", args, {})
        after = scrape(srv.base_url)
    hits, queries = (after.get(k, 0.0) - before.get(k, 0.0) for k in (HITS, QUERIES))
    return {
        "ttft_by_turn_s": ttft_by_turn(doc),
        "failed": doc["metrics"]["failed"],
        "prefix_cache_hits": hits,
        "prefix_cache_queries": queries,
        "hit_rate": hits / queries if queries else None,
    }


def report(on: dict[str, Any], off: dict[str, Any]) -> str:
    lines = [
        "| turn | TTFT on s | TTFT off s | on/off | target (turn >= 3: <= 0.3) |",
        "|---|---|---|---|---|",
    ]
    for i, (t_on, t_off) in enumerate(zip(on["ttft_by_turn_s"], off["ttft_by_turn_s"], strict=False)):
        ratio = t_on / t_off if t_off else float("nan")
        verdict = ("pass" if ratio <= 0.3 else "FAIL") if i >= 2 else ""
        lines.append(f"| {i + 1} | {t_on:.3f} | {t_off:.3f} | {ratio:.2f} | {verdict} |")
    for name, mode in (("on", on), ("off", off)):
        rate = "n/a" if mode["hit_rate"] is None else f"{mode['hit_rate']:.1%}"
        counts = f"{mode['prefix_cache_hits']:.0f} / {mode['prefix_cache_queries']:.0f} tokens"
        lines.append(f"\ncaching {name}: hit rate {rate} ({counts}, warm-up included), failed {mode['failed']}")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-len", type=int, default=1024)
    p.add_argument("--turn-len", type=int, default=64, help="tokens of each new user message")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=1, help="1: TTFTs without queueing")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    on, off = run_mode(True, a), run_mode(False, a)
    md = report(on, off)
    doc = {"settings": vars(a), "caching_on": on, "caching_off": off}
    (OUT / "prefix_cache.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    (OUT / "prefix_cache.md").write_text(md, encoding="utf-8")
    print(md + f"written under {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
