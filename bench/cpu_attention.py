"""The CPU path's paged-attention kernel (numba) on the default model's head shapes.

    .venv/bin/python bench/cpu_attention.py [--contexts 500 2000] [--rows 1 5 8] [--repeats 41]
        [--quant-context 4096] [--quant-repeats 3]

One layer: 9 query heads over 3 KV heads of 64, blocks of 16. Rows are one request's newest positions
(a decode row, or a window of speculative tokens); the best of `--repeats` runs is printed, in
microseconds, with the rate of its multiply-adds.

Then quantized pages (--kv-cache-dtype int8 / q4) at `--quant-context`: a prefill chunk of 512 rows of
one request ending there, and a decode step of 8 requests of one row each there; for each, the float
kernel on float pages, the row-wise kernel before (bench/rowwise_quantized_attention.py, which
dequantized per query row) and the current one (per request), best of `--quant-repeats`, side by side.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from rowwise_quantized_attention import rowwise_attend_quantized_rows

from metalserve.kernels.cpu import kv_quant
from metalserve.kernels.cpu.attention import attend_rows
from metalserve.kernels.cpu.quantized_attention import attend_quantized_rows

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


def quantized_arm(context: int, requests: int, rows: int, storage: str, repeats: int) -> dict[str, float]:
    """Best microseconds of the float kernel on float pages, and of the old and new kernels on `storage`'s."""
    rng = np.random.default_rng(0)
    blocks = context // BLOCK + 1
    pool = rng.standard_normal((2, KV_HEADS, requests * blocks * BLOCK, DIM), dtype=np.float32)
    tables = np.arange(requests * blocks, dtype=np.int32).reshape(requests, blocks)
    q = rng.standard_normal((requests * rows, HEADS, DIM), dtype=np.float32)
    positions = np.tile(np.arange(context - rows, context, dtype=np.int32), requests)
    owners = np.repeat(np.arange(requests, dtype=np.int32), rows)
    common = {"block_size": BLOCK, "scale": DIM**-0.5}
    codes, scales, biases = kv_quant.quantize(pool, storage, 32)
    scales = scales.reshape(*scales.shape[:3], -1)
    pages = (q, codes, scales, biases, tables, owners, positions)
    kernels = {
        "float": lambda: attend_rows(q, pool, tables, owners, positions, **common),
        "old": lambda: rowwise_attend_quantized_rows(*pages, **common),
        "new": lambda: attend_quantized_rows(*pages, **common),
    }
    np.testing.assert_allclose(kernels["new"](), kernels["old"](), atol=2e-5, rtol=0)
    best = dict.fromkeys(kernels, float("inf"))
    for round_ in range(repeats + 1):  # the kernels take turns, so that the machine's noise hits them alike
        for name, kernel in kernels.items():
            start = time.perf_counter()
            kernel()
            if round_:  # the first round compiles
                best[name] = min(best[name], 1e6 * (time.perf_counter() - start))
    return best


def quantized_table(context: int, repeats: int) -> None:
    print(f"\n| step at {context} | pages | float us | old us | new us | old / new | new / float |")
    print("|---|---|---|---|---|---|---|")
    for label, requests, rows in (("prefill chunk of 512", 1, 512), ("decode, 8 requests", 8, 1)):
        for storage in ("int8", "q4"):
            t = quantized_arm(context, requests, rows, storage, repeats)
            ratios = f"{t['old'] / t['new']:.2f} | {t['new'] / t['float']:.2f}"
            cells = f"{t['float']:.0f} | {t['old']:.0f} | {t['new']:.0f} | {ratios}"
            print(f"| {label} | {storage} | {cells} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[500, 2000])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 5, 8])
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument("--quant-context", type=int, default=4096)
    parser.add_argument("--quant-repeats", type=int, default=3)
    args = parser.parse_args()
    print("| context | rows | us per layer | GFLOP/s |\n|---|---|---|---|")
    for context in args.contexts:
        for rows in args.rows:
            us = best_us(context, rows, args.repeats)
            flops = 4 * rows * HEADS * context * DIM  # QK and PV, a multiply and an add each
            print(f"| {context} | {rows} | {us:.0f} | {flops / us / 1e3:.1f} |", flush=True)
    quantized_table(args.quant_context, args.quant_repeats)


if __name__ == "__main__":
    main()
