"""Speculative decoding (n-gram) on the default model: an edit workload and random chat, on and off.

Edit: each prompt holds a function from this repository and asks for it back with one identifier
renamed, so the answer re-emits the prompt (what prompt lookup predicts). Chat: short questions on
varied topics, sampled at temperature 0.8 with a seed per request, so both arms write the same text.
One engine serves both arms (speculation off: no proposer, so no drafts are ever scheduled); arms
alternate per cell, prefix caching off so no arm inherits the other's KV. Run by hand (minutes):
    .venv/bin/python bench/spec_decode.py [--k 4] [--requests 4] [--reps 2] [--edit-tokens 160] [--chat-tokens 64]
`--method draft_model` drafts with `--draft-model` instead (default: the default model drafting for
itself, which measures the batched draft path's cost at full acceptance, not a speed-up).
"""

from __future__ import annotations

import argparse
import ast
import builtins
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BUILTINS = set(dir(builtins)) | {"self", "cls"}
SOURCES = (
    "metalserve/scheduler/stop.py",
    "metalserve/kvcache/hashing.py",
    "metalserve/executor/seeding.py",
    "metalserve/scheduler/step.py",
    "metalserve/spec_decode/ngram.py",
    "metalserve/engine/request_state.py",
)
TOPICS = (
    "the ocean",
    "volcanoes",
    "the history of tea",
    "how bicycles work",
    "a good breakfast",
    "winter in Oslo",
    "learning the piano",
    "why cats purr",
    "the moon landing",
    "growing tomatoes",
    "jazz",
    "paper making",
    "the Roman roads",
    "sleep",
    "honey bees",
    "trains in Japan",
)


def functions(max_lines: int = 28) -> list[str]:
    """Top-level functions of a few repository files, 6..max_lines lines each, docstrings kept."""
    out = []
    for rel in SOURCES:
        source = (ROOT / rel).read_text()
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.end_lineno is not None:
                lines = source.splitlines()[node.lineno - 1 : node.end_lineno]
                if 6 <= len(lines) <= max_lines:
                    out.append("\n".join(lines))
    return out


def identifiers(code: str) -> list[str]:
    """Names the code uses more than once (variables, arguments): what an edit would rename."""
    tree = ast.parse(code)
    names = [n.id for n in ast.walk(tree) if isinstance(n, ast.Name)] + [
        a.arg for a in ast.walk(tree) if isinstance(a, ast.arg)
    ]
    names = [n for n in names if n not in BUILTINS]
    return sorted({n for n in names if names.count(n) > 1 and len(n) > 2}) or sorted(set(names))


def edit_prompts(n: int) -> list[str]:
    rng = random.Random(0)
    prompts = []
    for code in [f for _, f in zip(range(n), rng.sample(functions(), len(functions())) * n, strict=False)]:
        old = rng.choice(identifiers(code))
        prompts.append(f"Repeat this code exactly, renaming `{old}` to `{old}_v2`:\n```python\n{code}\n```")
    return prompts


def chat_prompts(n: int) -> list[str]:
    return [f"Tell me about {TOPICS[i % len(TOPICS)]}." for i in range(n)]


def run_cell(
    core: Any, prompts: list[list[int]], params: list[Any], concurrency: int, eos: frozenset[int]
) -> dict[str, Any]:
    """Keep `concurrency` requests in flight until all are done; per-request TTFT and TPOT."""
    from metalserve.request import Request

    before = core.make_stats()
    pending = list(range(len(prompts)))
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    cpu_first: dict[str, float] = {}  # the process's CPU time, steadier than wall time on shared cores
    cpu_last: dict[str, float] = {}
    counts: dict[str, int] = {}
    start, cpu_start = time.perf_counter(), time.process_time()
    arrival: dict[str, float] = {}

    def admit() -> None:
        i = pending.pop(0)
        rid = f"q{i}-{time.monotonic_ns()}"
        arrival[rid] = time.perf_counter()
        counts[rid] = 0
        core.add_request(Request(rid, prompts[i], params[i], eos_token_ids=eos))

    for _ in range(min(concurrency, len(pending))):
        admit()
    while core.has_unfinished_requests():
        for out in core.step():
            now = time.perf_counter()
            if out.new_token_ids:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
                cpu_first.setdefault(out.request_id, time.process_time())
                cpu_last[out.request_id] = time.process_time()
                counts[out.request_id] += len(out.new_token_ids)
            if out.finished and pending:
                admit()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    after = core.make_stats()
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    windows = after.spec_num_drafts - before.spec_num_drafts
    tpots = [(last[r] - first[r]) / (counts[r] - 1) for r in counts if counts[r] > 1]
    cpu_tpots = [(cpu_last[r] - cpu_first[r]) / (counts[r] - 1) for r in counts if counts[r] > 1]
    return {
        "requests": len(prompts),
        "output_tokens": sum(counts.values()),
        "wall_s": wall,
        "cpu_s": cpu,
        "output_tok_s": sum(counts.values()) / wall,
        "output_tok_per_cpu_s": sum(counts.values()) / cpu,
        "mean_tpot_ms": 1000 * statistics.mean(tpots),
        "mean_cpu_tpot_ms": 1000 * statistics.mean(cpu_tpots),
        "mean_ttft_s": statistics.mean(first[r] - arrival[r] for r in first),
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": 1 + accepted / windows if windows else None,
        "draft_tokens": drafted,
    }


def workloads(loaded: Any, args: argparse.Namespace) -> dict[str, tuple[list[list[int]], list[Any]]]:
    from metalserve.generate import encode_chat
    from metalserve.sampling_params import SamplingParams

    n = max(args.requests, 8)
    edit = [encode_chat(loaded, p) for p in edit_prompts(n)]
    chat = [encode_chat(loaded, p) for p in chat_prompts(n)]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.edit_tokens)
    sampled = [SamplingParams(temperature=0.8, seed=i, max_tokens=args.chat_tokens, ignore_eos=True) for i in range(n)]
    return {"edit": (edit, [greedy] * n), "chat": (chat, sampled)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--method", choices=("ngram", "draft_model"), default="ngram")
    parser.add_argument("--draft-model", default=None, help="draft_model: its path (default: the default model)")
    parser.add_argument("--workloads", default="edit,chat")
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--requests", type=int, default=4, help="requests per cell at concurrency 1")
    parser.add_argument("--edit-tokens", type=int, default=160)
    parser.add_argument("--chat-tokens", type=int, default=64)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--reps", type=int, default=2, help="on/off alternations per cell (order flips each time)")
    parser.add_argument("--out", default=str(ROOT / "bench/results/spec_decode.json"))
    args = parser.parse_args(argv)
    rows = bench(args)
    print(markdown(aggregate(rows)))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    return 0


def bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    from metalserve.config import EngineConfig
    from metalserve.generate import generate_config
    from metalserve.loader import load_model
    from metalserve.serving.build import build_engine_core
    from metalserve.speculative_config import SpeculativeConfig

    loaded = load_model(None)
    spec = SpeculativeConfig(args.method, args.k, args.lookup_min, args.lookup_max, model=args.draft_model)
    base = EngineConfig(max_num_batched_tokens=512, enable_prefix_caching=False, speculative_config=spec)
    core = build_engine_core(generate_config(loaded, 8, base), loaded)
    proposer = core.runner.proposer
    cells = {name: cell for name, cell in workloads(loaded, args).items() if name in args.workloads.split(",")}
    # numba compiles per shape on first use (tens of seconds): every cell's shapes once, both arms, untimed.
    for prompts, params in cells.values():
        for arm in (None, proposer):
            core.runner.proposer = arm
            run_cell(core, prompts[:2], params[:2], 2, loaded.eos_token_ids)
    rows = []
    for name, (prompts, params) in cells.items():
        for c in (int(x) for x in args.concurrency.split(",")):
            n = args.requests if c == 1 else max(c, args.requests)
            for rep in range(args.reps):
                for arm in ("off", "on") if rep % 2 == 0 else ("on", "off"):
                    core.runner.proposer = proposer if arm == "on" else None
                    row = {"workload": name, "concurrency": c, "speculation": arm, "rep": rep}
                    row |= run_cell(core, prompts[:n], params[:n], c, loaded.eos_token_ids)
                    print(json.dumps(row), file=sys.stderr)
                    rows.append(row)
    return rows


def aggregate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (workload, concurrency, arm) over the repetitions: tokens / wall, mean TPOT and TTFT."""
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["workload"], r["concurrency"], r["speculation"]), []).append(r)
    out = []
    for (workload, c, arm), rs in groups.items():
        drafted = sum(r["draft_tokens"] for r in rs)
        rates = [r["acceptance_rate"] * r["draft_tokens"] for r in rs if r["acceptance_rate"] is not None]
        lengths = [r["mean_acceptance_length"] for r in rs if r["mean_acceptance_length"] is not None]
        out.append(
            {
                "workload": workload,
                "concurrency": c,
                "speculation": arm,
                "draft_tokens": drafted,
                "output_tok_s": sum(r["output_tokens"] for r in rs) / sum(r["wall_s"] for r in rs),
                "output_tok_per_cpu_s": sum(r["output_tokens"] for r in rs) / sum(r["cpu_s"] for r in rs),
                "mean_tpot_ms": statistics.mean(r["mean_tpot_ms"] for r in rs),
                "mean_cpu_tpot_ms": statistics.mean(r["mean_cpu_tpot_ms"] for r in rs),
                "mean_ttft_s": statistics.mean(r["mean_ttft_s"] for r in rs),
                "acceptance_rate": sum(rates) / drafted if drafted else None,
                "mean_acceptance_length": statistics.mean(lengths) if lengths else None,
            }
        )
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table; speed-ups against the same cell's off arm: output tokens per wall second and per CPU
    second of this process (steadier where other programs share the cores), both with the prefill that
    speculation cannot change, and time per output token after the first (what speculation speeds up)."""
    lines = [
        "| workload | c | spec | output tok/s | tok per CPU-s | mean TPOT ms | CPU TPOT ms | mean TTFT s | "
        "acceptance | mean accepted length | speed-up (wall) | speed-up (CPU) | speed-up (TPOT) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    off: dict[tuple[str, int], dict[str, Any]] = {}
    for r in rows:
        key = (r["workload"], r["concurrency"])
        if r["speculation"] == "off":
            off[key] = r
        base = off.get(key) if r["speculation"] == "on" else None
        wall = f"{r['output_tok_s'] / base['output_tok_s']:.2f}x" if base else ""
        cpu = f"{r['output_tok_per_cpu_s'] / base['output_tok_per_cpu_s']:.2f}x" if base else ""
        tpot = f"{base['mean_tpot_ms'] / r['mean_tpot_ms']:.2f}x" if base else ""
        acc = f"{100 * r['acceptance_rate']:.0f}%" if r["acceptance_rate"] is not None else "-"
        length = f"{r['mean_acceptance_length']:.2f}" if r["mean_acceptance_length"] is not None else "-"
        lines.append(
            f"| {r['workload']} | {r['concurrency']} | {r['speculation']} | {r['output_tok_s']:.1f} | "
            f"{r['output_tok_per_cpu_s']:.1f} | {r['mean_tpot_ms']:.1f} | {r['mean_cpu_tpot_ms']:.1f} | "
            f"{r['mean_ttft_s']:.2f} | {acc} | "
            f"{length} | {wall} | {cpu} | {tpot} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
