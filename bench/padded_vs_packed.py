"""Padded vs packed batching: does one long prompt slow a batch of short ones down?

Batch A: 8 prompts of similar length. Batch B: one long prompt plus 7 short ones, with the same total
prompt tokens. 20 output tokens each (EOS ignored). Wall time per batch, median of repeated runs with
fresh prompts and fresh state: metalserve through its HTTP server (8 concurrent requests), mlx-lm through
its padded BatchGenerator on the same fp32 weights. The B/A ratio is ~1 for a packed engine and grows
with the padding for a padded one. Run by hand:
    .venv/bin/python bench/padded_vs_packed.py [--total-tokens 1024] [--repeats 5] [--base-url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from typing import Any

import httpx
from peers.bench_run import RESULTS
from peers.launch import MLX_DIR, RunningServer
from peers.servers import spec_for

from metalserve.benchmarks.client import RequestSettings, send_request
from metalserve.benchmarks.text_fill import random_text
from metalserve.benchmarks.tokenizer import LocalTokenizer, TokenCounter
from metalserve.blas import blas_description

OUT = RESULTS / "padded_vs_packed"
BATCH = 8


def batch_lengths(kind: str, total: int, short: int) -> list[int]:
    """A: 8 equal prompts; B: one long and 7 of `short` tokens. Both sum to `total`."""
    if kind == "A":
        return [total // BATCH] * BATCH
    if total - (BATCH - 1) * short <= short:
        raise ValueError("--total-tokens is too small for one long prompt plus 7 short ones")
    return [total - (BATCH - 1) * short] + [short] * (BATCH - 1)


def make_prompts(tok: TokenCounter, lengths: list[int], seed: int) -> list[str]:
    rng = random.Random(seed)
    return [random_text(tok, rng, n)[0] for n in lengths]


async def _metalserve_once(base_url: str, model: str, prompts: list[str], out_len: int) -> float:
    settings = RequestSettings(model, "/v1/completions", 0.0, ignore_eos=True)
    async with httpx.AsyncClient(base_url=base_url, timeout=3600) as client:
        start = time.perf_counter()
        sends = [send_request(client, settings, [{"role": "user", "content": p}], out_len) for p in prompts]
        outs = await asyncio.gather(*sends)
        wall = time.perf_counter() - start
    if failed := [o.error for o in outs if not o.success]:
        raise RuntimeError(f"metalserve failed requests: {failed[:2]}")
    return wall


def time_metalserve(base_url: str, batches: dict[str, list[list[str]]], out_len: int) -> dict[str, list[float]]:
    model = httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    times: dict[str, list[float]] = {k: [] for k in batches}
    for rep in range(len(batches["A"])):
        for kind, reps in batches.items():  # A and B interleaved: load drift hits both alike
            times[kind].append(asyncio.run(_metalserve_once(base_url, model, reps[rep], out_len)))
    return times


def time_mlx_lm(token_batches: dict[str, list[list[list[int]]]], out_len: int) -> dict[str, list[float]]:
    """mlx-lm's BatchGenerator, a fresh one per run, no stop tokens (so exactly `out_len` tokens each)."""
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    model, _ = load(str(MLX_DIR))
    times: dict[str, list[float]] = {k: [] for k in token_batches}
    for rep in range(len(token_batches["A"])):
        for kind, reps in token_batches.items():
            gen = BatchGenerator(model, stop_tokens=None, prefill_batch_size=BATCH, completion_batch_size=BATCH)
            start = time.perf_counter()
            gen.insert(reps[rep], [out_len] * BATCH)
            done = 0
            while done < BATCH and (responses := gen.next_generated()):
                done += sum(r.finish_reason is not None for r in responses)
            times[kind].append(time.perf_counter() - start)
            gen.close()
    return times


def summary(times: dict[str, list[float]], warmups: int) -> dict[str, Any]:
    a, b = statistics.median(times["A"][warmups:]), statistics.median(times["B"][warmups:])
    return {"A_median_s": a, "B_median_s": b, "B_over_A": b / a, "runs": times, "warmups_dropped": warmups}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--total-tokens", type=int, default=1024, help="prompt tokens per batch")
    p.add_argument("--short-len", type=int, default=16, help="batch B's short prompts")
    p.add_argument("--output-len", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmups", type=int, default=1)
    p.add_argument("--base-url", default=None, help="a running metalserve (default: start one)")
    p.add_argument("--engines", default="metalserve,mlx-lm")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    tok = LocalTokenizer(str(MLX_DIR))
    runs = a.warmups + a.repeats
    lengths = {k: batch_lengths(k, a.total_tokens, a.short_len) for k in ("A", "B")}
    # Fresh prompts for every run: no prefix cache or reused state can help.
    texts = {k: [make_prompts(tok, n, a.seed + 100 * r + (k == "B")) for r in range(runs)] for k, n in lengths.items()}
    results: dict[str, Any] = {}
    engines = a.engines.split(",")
    if "metalserve" in engines:
        if a.base_url:
            results["metalserve"] = summary(time_metalserve(a.base_url, texts, a.output_len), a.warmups)
        else:
            with RunningServer(spec_for("metalserve", BATCH), OUT / "metalserve.log") as srv:
                results["metalserve"] = summary(time_metalserve(srv.base_url, texts, a.output_len), a.warmups)
    if "mlx-lm" in engines:
        ids = {k: [[tok.encode(p) for p in rep] for rep in reps] for k, reps in texts.items()}
        results["mlx-lm"] = summary(time_mlx_lm(ids, a.output_len), a.warmups)
    lines = ["| engine | A median s | B median s | B/A |", "|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['A_median_s']:.3f} | {r['B_median_s']:.3f} | {r['B_over_A']:.2f} |")
    if "metalserve" in results:
        ok = results["metalserve"]["B_over_A"] <= 1.15
        lines.append(f"\nmetalserve B/A <= 1.15: {'pass' if ok else 'FAIL'}")
    md = f"prompt tokens per batch: A {lengths['A']}, B {lengths['B']}; {a.output_len} output tokens each\n"
    md += f"mlx-lm BLAS: {blas_description()}\n\n"
    md += "\n".join(lines) + "\n"
    OUT.mkdir(parents=True, exist_ok=True)
    doc = {"settings": vars(a), "lengths": lengths, "blas": blas_description(), "results": results}
    (OUT / "padded_vs_packed.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    (OUT / "padded_vs_packed.md").write_text(md, encoding="utf-8")
    print(md + f"written under {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
