"""Sweep concurrency over metalserve and its peers on the same GGUF weights; JSON, markdown and a PNG.

Each (server, concurrency) gets a fresh server on a free port and fresh prompts. Run by hand (minutes):
    .venv/bin/python bench/compare_peers.py [--servers metalserve,mlx-lm,...] [--levels 1,2,4,8,16]
Peers that are not installed are reported as such. Prepare them with the scripts in bench/peers/.
A/B of one setting, alternated so machine noise falls on both (async scheduling on and off):
    .venv/bin/python bench/compare_peers.py --servers metalserve,metalserve-no-async --levels 1,8 \
        --alternate 2 --out async_ab
The CPU path against llama-server on both the default model and the coder model (issue 36's table: c=1 and
c=8 decode, 4k and 16k prefills, resident memory; the servers in turn per workload, peers/cpu_table.py):
    .venv/bin/python bench/compare_peers.py --cpu-table [--models default,coder] \
        [--workloads c1,c8,prefill4k,prefill16k] [--threads 2] --out cpu_table
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from peers import cpu_table
from peers.bench_run import RESULTS, run_bench
from peers.launch import MLX_DIR, RunningServer, ServerStartError
from peers.servers import SERVERS, availability, spec_for


def _bench_args(a: argparse.Namespace, c: int, level_index: int) -> list[str]:
    # Fresh prompts per level (no server ever sees a prompt twice); the same prompts for every server.
    # Without the converted MLX directory the client asks the server's /tokenize.
    tokenizer = ["--tokenizer", str(MLX_DIR)] if (MLX_DIR / "config.json").exists() else []
    return [
        "--endpoint",
        "completions",
        *tokenizer,
        "--dataset-name",
        "random",
        "--input-len",
        str(a.input_len),
        "--output-len",
        str(a.output_len),
        "--ignore-eos",
        "--temperature",
        "0",
        "--num-prompts",
        str(max(a.min_prompts, a.prompts_per_client * c)),
        "--max-concurrency",
        str(c),
        "--seed",
        str(a.seed + 1000 * level_index),
        "--num-warmups",
        str(a.warmups),
        "--disable-tqdm",
    ]


def run_level(name: str, c: int, level_index: int, a: argparse.Namespace) -> dict[str, Any]:
    """One fresh server, one bench run; a row with the headline numbers or the error."""
    spec = spec_for(name, c, shlex.split(a.metalserve_args) if name == "metalserve" else None)
    out = RESULTS / a.out
    row: dict[str, Any] = {"server": name, "concurrency": c, "command": spec.command(0)}
    args = _bench_args(a, c, level_index) + (["--model", spec.model] if spec.model else [])
    try:
        with RunningServer(spec, out / "logs" / f"{name}-c{c}.log") as srv:
            doc = run_bench(srv.base_url, out / f"{name}-c{c}.json", args, spec.extra_body)
    except (ServerStartError, RuntimeError, OSError) as exc:
        return row | {"error": str(exc)}
    m = doc["metrics"]
    return row | {
        "completed": m["completed"],
        "failed": m["failed"],
        "mean_ttft_s": m["ttft_ms"]["mean"] / 1000,
        "median_ttft_s": m["ttft_ms"]["median"] / 1000,
        "mean_tpot_ms": m["tpot_ms"]["mean"],
        "mean_itl_ms": m["itl_ms"]["mean"],
        "output_tok_s": m["output_throughput"],
        "total_tok_s": m["total_token_throughput"],
    }


def _find(rows: list[dict[str, Any]], server: str, c: int) -> dict[str, Any] | None:
    return next((r for r in rows if r["server"] == server and r["concurrency"] == c and "error" not in r), None)


def _ratio(rows: list[dict[str, Any]], key: str, c: int, other: str) -> float | None:
    mine, theirs = _find(rows, "metalserve", c), _find(rows, other, c)
    if not mine or not theirs or not theirs[key]:
        return None
    return float(mine[key]) / float(theirs[key])


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets: (what, measured ratio, bound, pass); None where a side is missing."""
    checks = [
        ("c=8 output tok/s vs mlx-lm", _ratio(rows, "output_tok_s", 8, "mlx-lm"), ">=", 2.0),
        (
            "c=8 output tok/s vs llama-cpp-python",
            _ratio(rows, "output_tok_s", 8, "llama-cpp-python"),
            ">=",
            1.5,
        ),
        ("c=8 mean TTFT vs mlx-lm", _ratio(rows, "mean_ttft_s", 8, "mlx-lm"), "<=", 0.5),
        (
            "c=8 output tok/s vs llama-server --parallel 8",
            _ratio(rows, "output_tok_s", 8, "llama-server"),
            "",
            None,
        ),
        (
            "c=8 mean TTFT vs llama-server --parallel 8",
            _ratio(rows, "mean_ttft_s", 8, "llama-server"),
            "",
            None,
        ),
        ("c=1 TPOT vs llama-server", _ratio(rows, "mean_tpot_ms", 1, "llama-server"), "<=", 1.5),
        ("c=1 TPOT vs llama-cpp-python", _ratio(rows, "mean_tpot_ms", 1, "llama-cpp-python"), "<=", 1.5),
    ]
    out = []
    for what, value, op, bound in checks:
        ok = None if value is None or bound is None else (value >= bound if op == ">=" else value <= bound)
        out.append({"target": what, "ratio": value, "bound": f"{op} {bound}" if bound else "report", "pass": ok})
    return out


def markdown(rows: list[dict[str, Any]], checks: list[dict[str, Any]], status: dict[str, str]) -> str:
    lines = [
        "| server | concurrency | mean TTFT s | mean TPOT ms | output tok/s | completed/failed |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['server']} | {r['concurrency']} | failed: {r['error'][:80]!r} | | | |")
        else:
            nums = f"{r['mean_ttft_s']:.2f} | {r['mean_tpot_ms']:.1f} | {r['output_tok_s']:.1f}"
            lines.append(f"| {r['server']} | {r['concurrency']} | {nums} | {r['completed']}/{r['failed']} |")
    lines += ["", "| target | metalserve / peer | bound | pass |", "|---|---|---|---|"]
    for t in checks:
        ratio = "n/a" if t["ratio"] is None else f"{t['ratio']:.2f}"
        lines.append(f"| {t['target']} | {ratio} | {t['bound']} | {t['pass']} |")
    lines += ["", "Servers:"] + [f"- {k}: {v}" for k, v in status.items()]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name in dict.fromkeys(r["server"] for r in rows):
        ok = [r for r in rows if r["server"] == name and "error" not in r]
        if ok:
            cs = [r["concurrency"] for r in ok]
            ax1.plot(cs, [r["mean_ttft_s"] for r in ok], marker="o", label=name)
            ax2.plot(cs, [r["output_tok_s"] for r in ok], marker="o", label=name)
    for ax, label in ((ax1, "mean TTFT (s)"), (ax2, "output throughput (tok/s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default=",".join(SERVERS))
    p.add_argument("--levels", default="1,2,4,8,16")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prompts-per-client", type=int, default=2)
    p.add_argument("--min-prompts", type=int, default=4)
    p.add_argument("--warmups", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metalserve-args", default="", help="extra `metalserve serve` flags, e.g. a token budget")
    p.add_argument("--out", default="compare_peers", help="folder under bench/results for this sweep")
    p.add_argument(
        "--alternate",
        type=int,
        default=0,
        help="N rounds with the servers alternated within each level (an A/B of settings)",
    )
    p.add_argument("--cpu-table", action="store_true", help="issue 36's table: metalserve vs llama-server")
    p.add_argument("--models", default="default,coder", help="--cpu-table: 'default', 'coder' or GGUF paths")
    p.add_argument("--workloads", default=",".join(cpu_table.WORKLOADS), help="--cpu-table: which rows")
    p.add_argument("--threads", type=int, default=2, help="--cpu-table: threads for both servers")
    return p.parse_args(argv)


def main_cpu_table(a: argparse.Namespace) -> int:
    if unknown := set(a.workloads.split(",")) - set(cpu_table.WORKLOADS):
        print(f"error: unknown workloads {sorted(unknown)}; choose from {', '.join(cpu_table.WORKLOADS)}")
        return 2
    out = RESULTS / a.out
    out.mkdir(parents=True, exist_ok=True)
    flags = sorted(
        {f for f in Path("/proc/cpuinfo").read_text().split() if f.startswith(("avx512", "avx_vnni", "amx"))}
    )
    rows, checks = cpu_table.run_table(a, out)
    doc = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "settings": vars(a), "cpu_flags": flags, "rows": rows}
    (out / "cpu_table.json").write_text(json.dumps(doc | {"targets": checks}, indent=2) + "\n", encoding="utf-8")
    md = cpu_table.markdown(rows, checks) + f"\nCPU flags: {' '.join(flags)}\n"
    (out / "cpu_table.md").write_text(md, encoding="utf-8")
    print(md + f"\nwritten under {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.cpu_table:
        return main_cpu_table(a)
    names = [s.strip() for s in a.servers.split(",") if s.strip()]
    if unknown := set(names) - set(SERVERS):
        print(f"error: unknown servers {sorted(unknown)}; choose from {', '.join(SERVERS)}", file=sys.stderr)
        return 2
    levels = [int(x) for x in a.levels.split(",")]
    out = RESULTS / a.out
    out.mkdir(parents=True, exist_ok=True)
    status, usable, rows = {}, {}, []
    for name in names:
        usable[name], status[name] = availability(name)
        print(f"{name}: {status[name]}", flush=True)
    if a.alternate:  # rounds of (level, server) pairs, servers side by side within a level
        order = [(n, c, i + 1000 * r) for r in range(a.alternate) for i, c in enumerate(levels) for n in names]
    else:
        order = [(n, c, i) for n in names for i, c in enumerate(levels)]
    for name, c, i in order:
        row = run_level(name, c, i, a) if usable[name] else {"server": name, "concurrency": c, "error": status[name]}
        print(json.dumps({k: v for k, v in row.items() if k != "command"}), flush=True)
        rows.append(row)
    checks = targets(rows)
    doc = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "settings": vars(a),
        "servers": status,
        "rows": rows,
        "targets": checks,
    }
    (out / "compare_peers.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    md = markdown(rows, checks, status)
    (out / "compare_peers.md").write_text(md, encoding="utf-8")
    plot(rows, out / "compare_peers.png")
    print(md + f"\nwritten under {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
