"""The CPU path against llama-server (issue 36): c=1 and c=8 decode, 4k and 16k prefills, resident memory.

For each model and workload both servers run in turn on the same GGUF with the same thread count (the
order flips from one workload to the next, so a load spike from the machine's other work falls on both),
each a fresh server sized for the workload. Per row: TTFT, TPOT, output tok/s, prefill tok/s (prompt
tokens over TTFT at one stream), and the server's resident memory at the end (VmRSS) and at its peak
(VmHWM), beside the GGUF's size and the KV pool (metalserve's /debug/memory, llama-server's own log line).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from peers.bench_run import run_bench
from peers.launch import DEFAULT_GGUF, LLAMA_SERVER, RunningServer, ServerSpec, ServerStartError
from peers.servers import metalserve_cmd

CODER_GGUF = Path.home() / ".cache/metalserve/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
SLOT_CTX = 2048


@dataclass(frozen=True)
class Workload:
    name: str
    concurrency: int
    input_len: int
    output_len: int
    prompts: int

    @property
    def context(self) -> int:
        """Tokens one request may hold (a llama-server slot's context, metalserve's --max-model-len)."""
        return max(SLOT_CTX, self.input_len + self.output_len + 64)


WORKLOADS = {
    "c1": Workload("c1", 1, 256, 64, 4),
    "c8": Workload("c8", 8, 256, 64, 16),
    "prefill4k": Workload("prefill4k", 1, 4096, 2, 1),
    "prefill16k": Workload("prefill16k", 1, 16384, 2, 1),
}


def _spec(server: str, gguf: Path, w: Workload, threads: int, extra: list[str]) -> ServerSpec:
    host = ["--host", "127.0.0.1", "--port", "{port}"]
    if server == "metalserve":
        argv = [*metalserve_cmd(), "serve", str(gguf), *host, "--max-model-len", str(w.context), *extra]
        return ServerSpec(server, argv, env={"NUMBA_NUM_THREADS": str(threads)}, startup_timeout_s=1200)
    argv = [str(LLAMA_SERVER), "-m", str(gguf), *host, "-t", str(threads), "--parallel", str(w.concurrency)]
    return ServerSpec(server, [*argv, "-c", str(w.context * w.concurrency)], startup_timeout_s=600)


def _status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def _kv_pool_mb(server: str, srv: RunningServer) -> float | None:
    if server == "metalserve":
        try:
            return float(httpx.get(srv.base_url + "/debug/memory", timeout=30).json()["kv_pool"]) / 2**20
        except (httpx.HTTPError, KeyError, ValueError):
            return None
    sizes = re.findall(r"KV buffer size\s*=\s*([\d.]+) MiB", srv.log_path.read_text(errors="replace"))
    return sum(float(s) for s in sizes) if sizes else None


def _warm(srv: RunningServer, model: str | None) -> None:
    """A 300-token prompt first: metalserve loads its compiled kernels (both the decode and the prefill ones)
    on first use, llama-server allocates its buffers; neither belongs in the timed rows."""
    body: dict[str, Any] = {"prompt": "The quick brown fox jumps over the lazy dog. " * 30, "max_tokens": 4}
    if model:
        body["model"] = model
    httpx.post(srv.base_url + "/v1/completions", json=body, timeout=1800).raise_for_status()


def _model_name(srv: RunningServer) -> str | None:
    try:
        data = httpx.get(srv.base_url + "/v1/models", timeout=30).json()["data"]
        return str(data[0]["id"]) if data else None
    except (httpx.HTTPError, KeyError, ValueError, IndexError):
        return None


def run_one(server: str, gguf: Path, w: Workload, a: Any, out: Path) -> dict[str, Any]:
    extra = shlex.split(a.metalserve_args) if server == "metalserve" else []
    spec = _spec(server, gguf, w, a.threads, extra)
    tag = f"{gguf.stem}-{w.name}-{server}"
    row: dict[str, Any] = {"model": gguf.name, "workload": w.name, "server": server, "command": spec.command(0)}
    row["load_before"] = os.getloadavg()[0]
    args = ["--endpoint", "completions", "--dataset-name", "random", "--input-len", str(w.input_len)]
    args += ["--output-len", str(w.output_len), "--ignore-eos", "--temperature", "0", "--num-prompts", str(w.prompts)]
    args += ["--max-concurrency", str(w.concurrency), "--seed", str(a.seed), "--num-warmups", "0", "--disable-tqdm"]
    try:
        with RunningServer(spec, out / "logs" / f"{tag}.log") as srv:
            assert srv.proc is not None
            model = _model_name(srv)
            _warm(srv, model)
            doc = run_bench(srv.base_url, out / f"{tag}.json", args + (["--model", model] if model else []), {})
            row["rss_mb"] = _status_kb(srv.proc.pid, "VmRSS") / 1024
            row["peak_rss_mb"] = _status_kb(srv.proc.pid, "VmHWM") / 1024
            row["kv_pool_mb"] = _kv_pool_mb(server, srv)
    except (ServerStartError, RuntimeError, OSError, httpx.HTTPError) as exc:
        return row | {"error": str(exc)[-600:]}
    m = doc["metrics"]
    ttft = m["ttft_ms"]["mean"] / 1000
    row |= {
        "completed": m["completed"],
        "mean_ttft_s": ttft,
        "mean_tpot_ms": m["tpot_ms"]["mean"],
        "output_tok_s": m["output_throughput"],
        "prompt_tokens": m["total_input_tokens"],
        "prefill_tok_s": w.input_len / ttft if w.concurrency == 1 and ttft else None,
        "gguf_mb": gguf.stat().st_size / 2**20,
        "load_after": os.getloadavg()[0],
    }
    return row


def _pair(rows: list[dict[str, Any]], model: str, workload: str) -> tuple[dict | None, dict | None]:
    ok = [r for r in rows if r["model"] == model and r["workload"] == workload and "error" not in r]
    return (
        next((r for r in ok if r["server"] == "metalserve"), None),
        next((r for r in ok if r["server"] == "llama-server"), None),
    )


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's four targets per model: (what, metalserve / llama-server, bound, pass)."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        checks: list[tuple[str, str, str, str, float]] = [
            ("c=1 TPOT", "c1", "mean_tpot_ms", "<=", 1.0),
            ("prefill tok/s at 4k", "prefill4k", "prefill_tok_s", ">=", 1.0),
            ("prefill tok/s at 16k", "prefill16k", "prefill_tok_s", ">=", 1.0),
            ("c=8 output tok/s", "c8", "output_tok_s", ">=", 2.0),
        ]
        for what, workload, key, op, bound in checks:
            mine, theirs = _pair(rows, model, workload)
            ratio = mine[key] / theirs[key] if mine and theirs and mine.get(key) and theirs.get(key) else None
            ok = None if ratio is None else (ratio >= bound if op == ">=" else ratio <= bound)
            out.append({"model": model, "target": what, "ratio": ratio, "bound": f"{op} {bound}", "pass": ok})
        mine, _ = _pair(rows, model, "c8")
        if mine and mine.get("kv_pool_mb") is not None:
            ratio = mine["peak_rss_mb"] / (mine["gguf_mb"] + mine["kv_pool_mb"])
            out.append({"model": model, "target": "peak RSS / (GGUF + KV pool), c=8", "ratio": ratio,
                        "bound": "<= 1.3", "pass": ratio <= 1.3})  # fmt: skip
    return out


def markdown(rows: list[dict[str, Any]], checks: list[dict[str, Any]]) -> str:
    head = "| model | workload | server | TTFT s | TPOT ms | out tok/s | prefill tok/s | RSS MB | peak RSS MB |"
    lines = [head + " KV pool MB | load |", "|" + "---|" * 11]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['workload']} | {r['server']} | failed: {r['error'][:60]!r} |||||||| ")
            continue
        pre = f"{r['prefill_tok_s']:.1f}" if r["prefill_tok_s"] else "-"
        pool = f"{r['kv_pool_mb']:.0f}" if r["kv_pool_mb"] is not None else "?"
        nums = f"{r['mean_ttft_s']:.2f} | {r['mean_tpot_ms']:.1f} | {r['output_tok_s']:.1f} | {pre}"
        mem = f"{r['rss_mb']:.0f} | {r['peak_rss_mb']:.0f} | {pool} | {r['load_before']:.1f}-{r['load_after']:.1f}"
        lines.append(f"| {r['model']} | {r['workload']} | {r['server']} | {nums} | {mem} |")
    lines += ["", "| model | target | metalserve / llama-server | bound | pass |", "|---|---|---|---|---|"]
    for t in checks:
        ratio = "n/a" if t["ratio"] is None else f"{t['ratio']:.2f}"
        lines.append(f"| {t['model']} | {t['target']} | {ratio} | {t['bound']} | {t['pass']} |")
    return "\n".join(lines) + "\n"


def models_of(names: str) -> list[Path]:
    known = {"default": DEFAULT_GGUF, "coder": CODER_GGUF}
    return [known.get(n.strip(), Path(n.strip())) for n in names.split(",") if n.strip()]


def trained_context(gguf: Path) -> int | None:
    """The model's trained context from the GGUF's `<arch>.context_length`, or None if it names none."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf).fields
    arch_field = fields.get("general.architecture")
    if arch_field is None:
        return None
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode()
    field = fields.get(f"{arch}.context_length")
    return None if field is None else int(field.parts[field.data[0]][0])


def run_table(a: Any, out: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every (model, workload), the two servers in turn; rows printed as they finish."""
    import json

    if not LLAMA_SERVER.exists():
        print(f"llama-server not built: run bench/peers/build_llama_server.sh (no {LLAMA_SERVER})", file=sys.stderr)
    servers = ["metalserve", "llama-server"] if LLAMA_SERVER.exists() else ["metalserve"]
    rows: list[dict[str, Any]] = []
    turn = 0
    for gguf in models_of(a.models):
        trained = trained_context(gguf)
        for name in a.workloads.split(","):
            if trained is not None and WORKLOADS[name].context > trained:  # e.g. 16k on an 8k model
                print(f"{gguf.name}: {name} skipped: it needs {WORKLOADS[name].context} tokens, trained on {trained}")
                continue
            for server in servers if turn % 2 == 0 else servers[::-1]:
                t = time.monotonic()
                row = run_one(server, gguf, WORKLOADS[name], a, out) | {"wall_s": time.monotonic() - t}
                print(json.dumps({k: v for k, v in row.items() if k != "command"}), flush=True)
                rows.append(row)
            turn += 1
    return rows, targets(rows)
