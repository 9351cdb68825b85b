"""One projection through the packed-codes kernel at each stored width, side by side in one process.

    .venv/bin/python bench/packed_bits.py [--rows 1152] [--columns 896] [--tokens 1] [--repeat 400]

Random codes of 4, 5, 6 and 8 bits (groups of 32, 16 for 6 bits as Q6_K) packed as the loader packs
them (kernels/cpu/packed_codes.py), the arms interleaved for `--rounds`; prints each width's fastest call
(us: on a shared machine other work only adds) and its ratio to 8 bits. Defaults: the Qwen2.5-Coder-0.5B
qkv projection (896 -> 1152) at one token. Set NUMBA_NUM_THREADS to pin the threads.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from metalserve.kernels.cpu.packed_codes import PackedCodes
from metalserve.kernels.cpu.packed_linear import packed_linear, segments_of

GROUPS = {4: 32, 5: 32, 6: 16, 8: 32}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1152)
    ap.add_argument("--columns", type=int, default=896)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.tokens, args.columns)).astype(np.float32)
    arms = {}
    for bits, group in GROUPS.items():
        codes = rng.integers(0, 1 << bits, (args.rows, args.columns))
        scales = rng.random((args.rows, args.columns // group)).astype(np.float32)
        biases = rng.standard_normal((args.rows, args.columns // group)).astype(np.float32)
        packed = PackedCodes.pack(codes, scales, biases, bits)
        segments = segments_of([[packed]])
        want = x @ packed.dense().T
        np.testing.assert_allclose(packed_linear(x, segments), want, rtol=1e-3, atol=1e-2 * np.abs(want).max())
        arms[bits] = segments
    best = dict.fromkeys(arms, float("inf"))
    for _ in range(args.rounds):  # the fastest call of each arm: on a shared machine the mean is others' load
        for bits, segments in arms.items():
            for _ in range(args.repeat):
                start = time.perf_counter()
                packed_linear(x, segments)
                best[bits] = min(best[bits], (time.perf_counter() - start) * 1e6)
    print(f"{args.rows} x {args.columns}, {args.tokens} token(s): fastest call, us (ratio to 8 bits)")
    for bits, us in best.items():
        print(f"{bits} bits: {us:8.1f} ({us / best[8]:4.2f}x)")


if __name__ == "__main__":
    main()
