"""Where a long prefill's time goes on the CPU path, kernel by kernel, for one chunk at a given context.

    .venv/bin/python bench/cpu_prefill.py [--model PATH] [--chunk 512] [--contexts 512,4096,16384]
        [--old-tree /work/main] [--rounds 1] [--threads N] [--cpu-bf16-prefill off|on|both]

Loads the model's host decoder (weights in their codes), then times, for one `--chunk`-token prefill chunk
whose last row sits at each context: every projection of one layer (the packed-codes matmul), attention
over the chunk's causal context (one layer) and the rest of a layer (norms, RoPE, SwiGLU, the K/V write: the
whole decoder call minus the two), scaled to all layers. With `--old-tree` the same worker runs from that
checkout too, the arms alternating, each in its own process; the new / old ratios are printed per row.
`--cpu-bf16-prefill both` sets this tree's bfloat16 GEMMs (gemm.py) against its fp32 ones the same way.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]
CODER = Path.home() / ".cache/metalserve/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


def _best(fn: Any, repeats: int, warm: bool = True) -> float:
    if warm:
        fn()  # compiles, loads the numba cache
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def worker(model: str, chunk: int, contexts: list[int], repeats: int, bf16: str) -> dict[str, Any]:
    import numpy as np

    import metalserve  # noqa: F401  (before MLX: the BLAS)
    from metalserve.kernels.cpu import gemm

    if bf16 != "off":  # a tree from before the flag has only fp32 GEMMs
        gemm.set_bf16_mode(bf16)
    from metalserve.executor.host import paged_model
    from metalserve.kernels.cpu.attention import attend_rows
    from metalserve.kernels.cpu.decoder import decoder_layers
    from metalserve.kernels.cpu.packed_linear import packed_linear
    from metalserve.kernels.cpu.paged import CpuStepPlan
    from metalserve.loader import load_model
    from metalserve.platform import current_platform

    try:  # a tree with LoRA on the host decoder takes the adapters (none here) as two more arguments
        from metalserve.kernels.cpu.decoder_weights import NO_HOST_LORA, no_lora

        lora: tuple[Any, ...] = (no_lora(), NO_HOST_LORA)
    except ImportError:
        lora = ()
    loaded = load_model(model)
    paged = paged_model(loaded, current_platform())
    host = paged.compute.forward_on_host  # type: ignore[attr-defined]
    w, shape = host.weights, host.shape
    layers = w.input_norm.shape[0]
    hidden = w.input_norm.shape[1]
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {"layers": layers, "weights": loaded.weights_desc}
    for name in ("qkv", "o", "gate_up", "down"):
        seg = getattr(w, name)
        x = rng.standard_normal((chunk, seg.columns), dtype=np.float32)
        out[f"linear_{name}_ms"] = 1000 * layers * _best(lambda: packed_linear(x, seg, 0), repeats)  # noqa: B023
    bs = 16
    hq, hkv, d = shape.n_heads, shape.n_kv_heads, shape.head_dim
    for i, ctx in enumerate(contexts):
        slots = -(-ctx // bs) * bs
        pool = rng.standard_normal((2, hkv, slots, d), dtype=np.float32) * 0.5
        tables = np.arange(slots // bs, dtype=np.int32)[None]
        pos = np.arange(ctx - chunk, ctx, dtype=np.int32)
        req = np.zeros(chunk, np.int32)
        q = rng.standard_normal((chunk, hq, d), dtype=np.float32)
        t_att = _best(
            lambda: attend_rows(q, pool, tables, req, pos, block_size=bs, scale=shape.attention_scale),  # noqa: B023
            repeats,
            warm=i == 0,  # compiled once; a second call at 16k costs minutes on the old kernel
        )
        pools = tuple(pool.copy() for _ in range(layers))
        plan: Any = CpuStepPlan(pos.astype(np.int64), tables, req, pos, bs)
        if "plans" in inspect.signature(decoder_layers).parameters:  # a plan per layer (gemma3's two groups)
            plan = tuple(plan for _ in range(layers))
        h0 = rng.standard_normal((chunk, hidden), dtype=np.float32) * 0.1
        t_all = _best(lambda: decoder_layers(h0.copy(), w, shape, pools, plan, *lora), repeats, warm=i == 0)  # noqa: B023
        out[f"ctx{ctx}"] = {"attention_ms": 1000 * layers * t_att, "decoder_ms": 1000 * t_all}
    return out


def _rows(res: dict[str, Any], contexts: list[int], chunk: int) -> dict[str, float]:
    linear = sum(v for k, v in res.items() if k.startswith("linear_"))
    rows = {k: v for k, v in res.items() if k.startswith("linear_")}
    rows["linear_all_ms"] = linear
    for ctx in contexts:
        c = res[f"ctx{ctx}"]
        rows[f"ctx{ctx}_attention_ms"] = c["attention_ms"]
        rows[f"ctx{ctx}_decoder_ms"] = c["decoder_ms"]
        rows[f"ctx{ctx}_rest_ms"] = c["decoder_ms"] - c["attention_ms"] - linear
        rows[f"ctx{ctx}_tok_s"] = chunk / (c["decoder_ms"] / 1000)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(CODER))
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--contexts", default="512,4096,16384")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--old-tree", default=None)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="NUMBA_NUM_THREADS (0: numba's own)")
    ap.add_argument(
        "--cpu-bf16-prefill",
        default="off",
        choices=("off", "on", "both"),
        help="the GEMMs in bfloat16 (MKL, AMX where present); both: an fp32 and a bf16 arm of this tree",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    contexts = [int(c) for c in a.contexts.split(",")]
    if a.worker:
        print(json.dumps(worker(a.model, a.chunk, contexts, a.repeats, a.cpu_bf16_prefill)))
        return
    # (label, tree, --cpu-bf16-prefill): ratios are the first arm's over the second's
    if a.cpu_bf16_prefill == "both":
        arms = [("bf16", HERE, "on"), ("fp32", HERE, "off")]
    else:
        old = [("old", Path(a.old_tree), a.cpu_bf16_prefill)] if a.old_tree else []  # the same mode in both
        arms = [("new", HERE, a.cpu_bf16_prefill), *old]
    results: dict[str, list[dict[str, float]]] = {arm: [] for arm, _, _ in arms}
    print(f"model {a.model}; chunk {a.chunk}; load {os.getloadavg()[0]:.1f}", flush=True)
    for r in range(a.rounds):
        for arm, tree, bf16 in arms if r % 2 == 0 else arms[::-1]:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", a.model]
            cmd += ["--cpu-bf16-prefill", bf16]
            cmd += ["--chunk", str(a.chunk), "--contexts", a.contexts, "--repeats", str(a.repeats)]
            env = {**os.environ, "PYTHONPATH": str(tree)}
            if a.threads:
                env["NUMBA_NUM_THREADS"] = str(a.threads)
            done = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, check=False)
            if done.returncode:
                raise SystemExit(f"{tree}: {done.stderr[-3000:]}")
            res = json.loads(done.stdout.strip().splitlines()[-1])
            results[arm].append(_rows(res, contexts, a.chunk))
            print(f"round {r + 1} {arm} (load {os.getloadavg()[0]:.1f}): {json.dumps(results[arm][-1])}", flush=True)
    first, second = arms[0][0], arms[-1][0]
    keys = list(results[first][0])
    med = {arm: {k: statistics.median(x[k] for x in rs) for k in keys} for arm, rs in results.items()}
    ratio = len(arms) > 1
    print(f"{'(all layers, ms)':28}" + "".join(f"{arm:>12}" for arm in med) + (f"  {first}/{second}" if ratio else ""))
    for k in keys:
        line = f"{k:28}" + "".join(f"{med[arm][k]:12.1f}" for arm in med)
        if ratio and med[second][k]:
            line += f"{med[first][k] / med[second][k]:10.2f}"
        print(line)


if __name__ == "__main__":
    main()
