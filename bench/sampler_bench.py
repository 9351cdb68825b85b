"""Time one Sampler call per step at several batch sizes (vocab 49152, the default model's).

    .venv/bin/python bench/sampler_bench.py [--batch 1 8 32] [--repeat 10] [--backend auto|mlx|numpy]

Logits are synthetic: Gaussian noise plus a few strong tokens, roughly as peaked as a small LM's.
Prints the best wall time and the best process CPU time per call: on a shared machine the CPU time
is the steadier measure of what a call costs.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

# isort: off
import metalserve  # noqa: F401  (must come before MLX: it loads the optimized BLAS that MLX then binds)

# isort: on
import mlx.core as mx
import numpy as np

from metalserve.executor.sampler import Sampler
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams

VOCAB = 49152
PROMPT = 256
OUTPUT = 64

CASES: dict[str, Callable[[int], SamplingParams]] = {
    "greedy": lambda i: SamplingParams(temperature=0.0),
    "greedy+penalties": lambda i: SamplingParams(temperature=0.0, repetition_penalty=1.1, presence_penalty=0.3),
    "temperature": lambda i: SamplingParams(temperature=0.8),
    "top_p (no top_k)": lambda i: SamplingParams(temperature=0.8, top_p=0.95),
    "full": lambda i: SamplingParams(
        temperature=0.8,
        top_k=50,
        top_p=0.95,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=0.3,
        frequency_penalty=0.2,
        logit_bias={5: 1.0},
        seed=i,
        logprobs=5,
    ),
}


def make_logits(batch: int, rng: np.random.Generator) -> mx.array:
    logits = rng.normal(scale=2.0, size=(batch, VOCAB)).astype(np.float32)
    peaks = rng.integers(0, VOCAB, size=(batch, 8))
    np.put_along_axis(logits, peaks, rng.uniform(12.0, 16.0, size=(batch, 8)).astype(np.float32), axis=-1)
    return mx.array(logits)


def time_case(case: str, batch: int, repeat: int, backend: str) -> tuple[float, float]:
    """Best wall and CPU milliseconds per call."""
    rng = np.random.default_rng(0)
    requests = [
        Request(
            f"r{i}",
            rng.integers(0, VOCAB, PROMPT).tolist(),
            CASES[case](i),
            eos_token_ids=frozenset({2}),
            output_token_ids=rng.integers(0, VOCAB, OUTPUT).tolist(),
        )
        for i in range(batch)
    ]
    logits = make_logits(batch, rng)
    mx.eval(logits)
    sampler = Sampler(0, backend=backend)
    sampler(logits, requests)  # warm-up
    wall, cpu = [], []
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.process_time()
        sampler(logits, requests)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return min(wall) * 1e3, min(cpu) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--case", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--backend", choices=["auto", "mlx", "numpy"], default="auto")
    args = parser.parse_args()
    print(f"vocab {VOCAB}, prompt {PROMPT}, output {OUTPUT}, backend {args.backend}")
    print(f"ms per call, best of {args.repeat}: wall / CPU")
    print(f"{'case':<18}" + "".join(f"{'B=' + str(b):>16}" for b in args.batch))
    for case in args.case:
        cells = [time_case(case, b, args.repeat, args.backend) for b in args.batch]
        print(f"{case:<18}" + "".join(f"{w:>8.2f} /{c:>6.2f}" for w, c in cells), flush=True)


if __name__ == "__main__":
    main()
