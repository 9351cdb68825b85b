"""The CPU fast path with weights in their codes vs the fp32 copy it replaced: decode, prefill, memory.

    .venv/bin/python bench/cpu_codes.py [--model PATH] [--old-tree /work/main] [--rounds 2]
        [--prefill 4096] [--steps 24] [--threads N]

Each arm runs in its own process (so its resident memory is its own), the arms alternating for
`--rounds` rounds: "old" imports metalserve from `--old-tree` (a checkout before this change: fp32
weights for MKL plus one byte a weight for the decode kernel), "new" from this checkout (the GGUF's
codes, packed, and nothing else). Both load with `--weights auto` and run the paged runner with the CPU
attention backend. Printed per arm: decode TPOT at one stream (median step, 256-token context),
a `--prefill`-token prompt in the server's 512-token chunks, and resident memory after load and at the
end; then the new / old ratios. On a machine whose cores other work keeps busy, `--threads 1` keeps
both arms off numba's fork-join, where a preempted worker stalls every parallel region.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def worker(model: str | None, prefill: int, steps: int) -> dict[str, float]:
    import resource

    import metalserve  # noqa: F401  (before MLX: the BLAS)
    from metalserve.executor.attention.cpu import CpuAttention
    from metalserve.executor.runner import ModelRunner
    from metalserve.executor.sampler import Sampler
    from metalserve.loader import load_model
    from metalserve.platform import current_platform
    from metalserve.sampling_params import SamplingParams
    from metalserve.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput

    t = time.perf_counter()
    loaded = load_model(model)
    try:
        from metalserve.executor.host import paged_model
    except ImportError:  # an old tree: the adapter built itself
        from metalserve.executor.models.adapter import PagedModel

        paged_model = PagedModel.from_loaded  # type: ignore[attr-defined]
    paged = paged_model(loaded, current_platform())
    load_s = time.perf_counter() - t
    rss_loaded = _rss_mb()
    bs, chunk = 16, 512
    blocks = -(-(prefill + 512) // bs) + 8
    spec = paged.get_kv_cache_spec(paged.family.page(loaded.model), bs, blocks)
    runner = ModelRunner(paged, spec, eos_token_ids=frozenset(), sampler=Sampler(0), backend=CpuAttention())
    params = SamplingParams(temperature=0, max_tokens=1 << 20, ignore_eos=True)
    table = (list(range(blocks)),)

    def run_prompt(rid: str, prompt: list[int]) -> float:
        start = time.perf_counter()
        first = prompt[:chunk]
        new = NewRequestData(rid, prompt, len(prompt), params, table, 0)
        runner.execute_model(SchedulerOutput([new], [], {rid: len(first)}, len(first)))
        done = len(first)
        while done < len(prompt):
            n = min(chunk, len(prompt) - done)
            cached = [CachedRequestData(rid, ([],), done)]
            runner.execute_model(SchedulerOutput([], cached, {rid: n}, n))
            done += n
        return time.perf_counter() - start

    def finish(rid: str) -> None:
        runner.execute_model(SchedulerOutput([], [], {}, 0, finished_req_ids={rid}))

    rng = __import__("numpy").random.default_rng(0)
    vocab = min(int(loaded.config.get("vocab_size", 32000)), 30000)
    run_prompt("warm", rng.integers(0, vocab, 600).tolist())  # compiles both step sizes
    finish("warm")
    prefill_s = run_prompt("long", rng.integers(0, vocab, prefill).tolist())
    finish("long")
    context = 256
    run_prompt("d", rng.integers(0, vocab, context).tolist())
    computed = context
    times = []
    for i in range(steps + 2):
        t = time.perf_counter()
        runner.execute_model(SchedulerOutput([], [CachedRequestData("d", ([],), computed)], {"d": 1}, 1))
        if i >= 2:
            times.append(time.perf_counter() - t)
        computed += 1
    return {
        "load_s": load_s,
        "tpot_ms": 1000 * statistics.median(times),
        "prefill_tok_s": prefill / prefill_s,
        "rss_loaded_mb": rss_loaded,
        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "weights": loaded.weights_desc,  # type: ignore[dict-item]
    }


def _run_arm(tree: Path, args: argparse.Namespace) -> dict[str, float]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--prefill", str(args.prefill)]
    cmd += ["--steps", str(args.steps)] + (["--model", args.model] if args.model else [])
    env = {**os.environ, "PYTHONPATH": str(tree)}
    if args.threads:
        env["NUMBA_NUM_THREADS"] = str(args.threads)
    out = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"{tree}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a GGUF path (default: the embedded default model)")
    ap.add_argument("--old-tree", default="/work/main")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=0, help="NUMBA_NUM_THREADS for both arms (0: numba's own)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.model, args.prefill, args.steps)))
        return
    flags = sorted(
        {
            f
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
            for f in line.split(":")[1].split()
            if f.startswith(("avx512", "avx_vnni", "amx"))
        }
    )
    print(f"model {args.model or 'embedded default'}; cpu flags: {' '.join(flags) or 'no AVX-512'}")
    results: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    for r in range(args.rounds):
        for arm, tree in (("old", Path(args.old_tree)), ("new", HERE)):
            res = _run_arm(tree, args)
            results[arm].append(res)
            print(f"round {r + 1} {arm}: {json.dumps(res)}", flush=True)
    keys = ("tpot_ms", "prefill_tok_s", "rss_loaded_mb", "max_rss_mb", "load_s")
    med = {arm: {k: statistics.median(x[k] for x in rs) for k in keys} for arm, rs in results.items()}
    print(f"{'':14}" + "".join(f"{k:>15}" for k in keys))
    for arm in ("old", "new"):
        print(f"{arm:14}" + "".join(f"{med[arm][k]:15.1f}" for k in keys))
    print(f"{'new / old':14}" + "".join(f"{med['new'][k] / med['old'][k]:15.2f}" for k in keys))


if __name__ == "__main__":
    main()
