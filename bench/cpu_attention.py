"""The CPU path's paged-attention kernel (numba) on the default model's head shapes.

    .venv/bin/python bench/cpu_attention.py [--contexts 500 2000] [--rows 1 5 8] [--repeats 41]

One layer: 9 query heads over 3 KV heads of 64, blocks of 16. Rows are one request's newest positions
(a decode row, or a window of speculative tokens); the best of `--repeats` runs is printed, in
microseconds, with the rate of its multiply-adds.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from metalserve.kernels.cpu.attention import attend_rows

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


def best_us(context: int, rows: int, repeats: int) -> float:
    rng = np.random.default_rng(0)
    blocks = context // BLOCK + 1
    pool = rng.random((2, KV_HEADS, blocks * BLOCK, DIM), dtype=np.float32)
    tables = np.arange(blocks, dtype=np.int32)[None]
    q = rng.random((rows, HEADS, DIM), dtype=np.float32)
    positions = np.arange(context - rows, context, dtype=np.int32)
    requests = np.zeros(rows, np.int32)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        attend_rows(q, pool, tables, requests, positions, block_size=BLOCK, scale=DIM**-0.5)
        times.append(time.perf_counter() - start)
    return 1e6 * min(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[500, 2000])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 5, 8])
    parser.add_argument("--repeats", type=int, default=41)
    args = parser.parse_args()
    print("| context | rows | us per layer | GFLOP/s |\n|---|---|---|---|")
    for context in args.contexts:
        for rows in args.rows:
            us = best_us(context, rows, args.repeats)
            flops = 4 * rows * HEADS * context * DIM  # QK and PV, a multiply and an add each
            print(f"| {context} | {rows} | {us:.0f} | {flops / us / 1e3:.1f} |", flush=True)


if __name__ == "__main__":
    main()
