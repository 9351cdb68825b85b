"""Decode TPOT on the CPU fast path over float, int8, q4 and k8v4 KV pages, side by side in one process.

    .venv/bin/python bench/cpu_kv_pages.py [--model PATH] [--contexts 512,4096] [--steps 16] [--rounds 2]

One model load (the GGUF's codes, `--weights auto`); per round each arm builds its runner (the CPU
attention backend; quantized pages Hadamard-rotated, as the engine builds them), prefills a prompt of
each context in 512-token chunks and times `--steps` single-token decode steps (median). Arms:
`auto` (float32 pages), `int8`, `q4`, `k8v4` (int8 K, q4 V) through the one-call host decoder, and
`int8-layers` / `q4-layers` / `k8v4-layers`:
the same pages with the host decoder removed (the per-layer route quantized pages took before). Set
NUMBA_NUM_THREADS to pin the threads. Prints each arm's median TPOT per context and its ratio to `auto`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from typing import Any


def _runner(paged: Any, loaded: Any, storage: str, host_forward: Any, blocks: int) -> Any:
    from metalserve.executor.attention.cpu import CpuAttention
    from metalserve.executor.attention.rotation import RotatedPages
    from metalserve.executor.runner import ModelRunner
    from metalserve.executor.sampler import Sampler

    page = replace(paged.family.page(loaded.model), storage=storage)
    spec = paged.get_kv_cache_spec(page, 16, blocks)
    paged.compute.forward_on_host = host_forward
    backend = CpuAttention() if storage == "auto" else RotatedPages(CpuAttention())
    return ModelRunner(paged, spec, eos_token_ids=frozenset(), sampler=Sampler(0), backend=backend)


def _tpot_ms(runner: Any, prompt: list[int], steps: int, blocks: int) -> float:
    from metalserve.sampling_params import SamplingParams
    from metalserve.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput

    params = SamplingParams(temperature=0, max_tokens=1 << 20, ignore_eos=True)
    table = (list(range(blocks)),)
    first = prompt[:512]
    new = NewRequestData("d", prompt, len(prompt), params, table, 0)
    runner.execute_model(SchedulerOutput([new], [], {"d": len(first)}, len(first)))
    done = len(first)
    while done < len(prompt):
        n = min(512, len(prompt) - done)
        runner.execute_model(SchedulerOutput([], [CachedRequestData("d", ([],), done)], {"d": n}, n))
        done += n
    times = []
    for i in range(steps + 2):
        t = time.perf_counter()
        runner.execute_model(SchedulerOutput([], [CachedRequestData("d", ([],), done)], {"d": 1}, 1))
        if i >= 2:
            times.append(time.perf_counter() - t)
        done += 1
    runner.execute_model(SchedulerOutput([], [], {}, 0, finished_req_ids={"d"}))
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a GGUF path (default: the embedded default model)")
    ap.add_argument("--contexts", default="512,4096")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--arms", default="auto,int8,q4,k8v4,int8-layers,q4-layers")
    args = ap.parse_args()
    import numpy as np

    import metalserve  # noqa: F401  (before MLX: the BLAS)
    from metalserve.executor.host import paged_model
    from metalserve.loader import load_model
    from metalserve.platform import current_platform

    loaded = load_model(args.model)
    paged = paged_model(loaded, current_platform())
    host_forward = paged.compute.forward_on_host
    contexts = [int(c) for c in args.contexts.split(",")]
    arms = args.arms.split(",")
    blocks = max(contexts) // 16 + args.steps // 16 + 8
    rng = np.random.default_rng(0)
    vocab = min(int(loaded.config.get("vocab_size", 32000)), 30000)
    prompts = {c: rng.integers(0, vocab, c).tolist() for c in contexts}
    results: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for arm in arms:
            storage, host = arm.removesuffix("-layers"), not arm.endswith("-layers")
            runner = _runner(paged, loaded, storage, host_forward if host else None, blocks)
            _tpot_ms(runner, prompts[contexts[0]][:64], 2, blocks)  # compiles this arm's kernels
            for c in contexts:
                results.setdefault((arm, c), []).append(_tpot_ms(runner, prompts[c], args.steps, blocks))
    print(f"model: {loaded.weights_desc}; TPOT ms (median step; best of {args.rounds} rounds), ratio to auto")
    print("arm".ljust(14) + "".join(f"ctx {c}".rjust(22) for c in contexts))
    for arm in arms:
        cells = []
        for c in contexts:
            ms, base = min(results[(arm, c)]), min(results[("auto", c)]) if "auto" in arms else float("nan")
            cells.append(f"{ms:8.2f} ({ms / base:4.2f}x)".rjust(22))
        print(arm.ljust(14) + "".join(cells))


if __name__ == "__main__":
    main()
