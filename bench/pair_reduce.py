"""A stage's two tensor-parallel ranks on MLX's ring backend (no group split): the send/recv exchange that
stands in for a sub-group all-reduce (distributed/subgroup.py `PairGroup`) against the ring's own
`all_sum` over the same two ranks, side by side (alternating, same sizes), each evaluated at once.

    .venv/bin/python bench/pair_reduce.py [--sizes 4096 65536 1048576] [--reps 20]

It starts rank 1 itself (this script again, with MLX_RANK=1). Prints the median and minimum microseconds
per all-reduce of each arm and their ratio (pair / all_sum), on rank 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

# isort: off
import metalserve  # noqa: F401  (must come before MLX: it loads the optimized BLAS that MLX then binds)

# isort: on
import mlx.core as mx

from metalserve.distributed.launch import init_group, write_local_hostfile
from metalserve.distributed.subgroup import PairGroup


def timed(fn: object, x: mx.array) -> float:
    t0 = time.perf_counter()
    mx.eval(fn(x))  # type: ignore[operator]
    return (time.perf_counter() - t0) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 65536, 1 << 20], help="bytes (fp32)")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    child = None
    if "MLX_RANK" not in os.environ:
        os.environ.update(MLX_HOSTFILE=write_local_hostfile(2), MLX_RANK="0")
        child = subprocess.Popen([sys.executable, *sys.argv], env={**os.environ, "MLX_RANK": "1"})
    world = init_group(2, "--tensor-parallel-size")
    pair = PairGroup(world, (0, 1))
    arms = {"pair send/recv": pair.all_sum, "ring all_sum": lambda x: mx.distributed.all_sum(x, group=world)}
    for size in args.sizes:
        x = mx.ones((size // 4,), mx.float32) * (world.rank() + 1)
        mx.eval(x)
        for name, fn in arms.items():  # both arms sum 1 + 2 on both ranks
            if not mx.all(fn(x) == 3).item():
                raise SystemExit(f"{name}: wrong sum")
        times: dict[str, list[float]] = {name: [] for name in arms}
        for rep in range(args.reps + 2):
            for name, fn in arms.items():
                t = timed(fn, x)
                if rep >= 2:  # warm-up
                    times[name].append(t)
        if world.rank() == 0:
            med = {n: statistics.median(v) for n, v in times.items()}
            line = ", ".join(f"{n}: median {med[n]:.0f} us (min {min(times[n]):.0f})" for n in arms)
            print(f"{size} B: {line}; ratio of medians {med['pair send/recv'] / med['ring all_sum']:.2f}")
    if child is not None:
        child.wait(120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
