"""Hybrid models (gated delta, short conv, Mamba2) on MLX's CPU backend: prefill and decode step times.

    .venv/bin/python bench/hybrid_step.py [--types qwen3_next lfm2] [--prompt 256] [--batch 8] [--steps 16]

The tests' tiny random models (hidden 64, 4-5 layers) served by the real engine: one prefill of
`--prompt` tokens alone, then `--batch` requests decoding together (their decode rows run as one batch per
recurrent layer). Prints the median step time of each phase; run it once, it is not a loop benchmark.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

# isort: off
import metalserve  # noqa: F401  (must come before MLX: it loads the optimized BLAS that MLX then binds)

# isort: on
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from metalserve.request import Request  # noqa: E402
from metalserve.sampling_params import SamplingParams  # noqa: E402
from tests.models.hybrid_golden import engine, prompts_of  # noqa: E402
from tests.models.hybrid_tiny import HYBRID_TYPES, tiny_hybrid_loaded  # noqa: E402


def timed_steps(core, n: int) -> list[float]:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(n):
        t = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t)
    return times


def bench(model_type: str, prompt: int, batch: int, steps: int) -> str:
    core = engine(tiny_hybrid_loaded(model_type), budget=max(prompt, batch * 8), num_blocks=512)
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    core.add_request(Request("warm", prompts_of([8])[0], params))
    timed_steps(core, 3)  # first calls compile MLX's kernels
    core.add_request(Request("long", prompts_of([prompt], seed=2)[0], SamplingParams(temperature=0, max_tokens=1)))
    (prefill,) = timed_steps(core, 1)
    for i, p in enumerate(prompts_of([8] * batch, seed=3)):
        core.add_request(Request(f"d{i}", p, params))
    timed_steps(core, 2)
    decode = statistics.median(timed_steps(core, steps))
    return (
        f"{model_type:11s} prefill {prompt} tokens {prefill * 1e3:7.1f} ms"
        f" | decode x{batch} {decode * 1e3:6.1f} ms/step"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", nargs="+", default=list(HYBRID_TYPES))
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()
    for t in args.types:
        print(bench(t, args.prompt, args.batch, args.steps), flush=True)


if __name__ == "__main__":
    main()
