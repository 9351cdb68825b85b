"""The vocabulary projection on MLX's CPU backend: MLX's matmul (through its BLAS) vs NumPy's, same weights.

    .venv/bin/python bench/lm_head.py [--vocab 49152] [--hidden 576] [--batches 1 8 32]

Why `PagedModel` computes logits with NumPy on the CPU (see metalserve/executor/models/adapter.py).
Prints the median time of each and their ratio, measured alternately in one process.
"""

from __future__ import annotations

import argparse
import statistics
import time

# isort: off
import metalserve  # noqa: F401  (must come before MLX: it loads the optimized BLAS that MLX then binds)

# isort: on
import mlx.core as mx
import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    weight = mx.random.normal((args.vocab, args.hidden))
    mx.eval(weight)
    host = np.asarray(weight)
    print("| batch | MLX (ms) | NumPy (ms) | MLX / NumPy |\n|---|---|---|---|")
    for batch in args.batches:
        x = mx.random.normal((batch, args.hidden))
        mx.eval(x)
        fns = {
            "mlx": lambda x=x: mx.eval(x @ weight.T),
            "numpy": lambda x=x: mx.eval(mx.array(np.asarray(x) @ host.T)),
        }
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(args.repeats + 1):  # the first round warms up and is dropped
            for name, fn in fns.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        a, b = (statistics.median(times[n][1:]) * 1e3 for n in ("mlx", "numpy"))
        print(f"| {batch} | {a:.2f} | {b:.2f} | {a / b:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
