"""The decode matvec with int8 activations (`--cpu-int8-activations`, kernels/cpu/int8_dot.py: VNNI's
`vpdpbusd` where the CPU has it) against the float kernel, one projection at a time.

    PYTHONPATH=$PWD NUMBA_NUM_THREADS=1 .venv/bin/python bench/cpu_int8_dot.py [--repeat 50] [--rounds 5] \
        [--tokens 1]

Random codes packed as the loader packs them, at the decode projections of the default model (576 wide,
Q4_1 and its Q8_0 head) and the coder 0.5B (896 / 4864 wide). `--tokens` input rows (one: a decode step of
one request; 8: of eight, kernels/cpu/int8_windows.py for 5- and 6-bit codes); the two arms interleaved for
`--rounds`. Printed per shape: each arm's fastest call, the ratio, and each arm's largest error against
float64 relative to the largest output. Each call from Python also pays a fixed cost both arms share
(~50 us here: the dispatch, unboxing the segments' typed lists, the parallel launch) that the host decoder,
calling from compiled code, does not: the ratios understate the kernel's gain on small projections.
"""

from __future__ import annotations

import argparse
import time

# isort: off
import metalserve  # noqa: F401  (before numba: it points numba's cache at this version's folder)

# isort: on
import numba
import numpy as np

from metalserve.kernels.cpu import int8_dot
from metalserve.kernels.cpu.packed_codes import PackedCodes
from metalserve.kernels.cpu.packed_linear import packed_linear, segments_of

SHAPES = [  # (rows, columns, bits, group size)
    (1536, 576, 4, 32),
    (576, 1536, 4, 32),
    (49152 // 4, 576, 8, 32),
    (9728, 896, 4, 32),
    (896, 4864, 4, 32),
    (1152, 896, 8, 32),
    (9728, 896, 5, 32),  # the coder 0.5B's Q5_0 gate/up and qkv
    (1152, 896, 5, 32),
    (896, 4864, 6, 16),  # its Q6_K down
]


def measure(
    rows: int, columns: int, bits: int, repeat: int, rounds: int, group: int = 32, tokens: int = 1
) -> dict[str, float]:
    """Fastest seconds of each arm ("float", "int8") and each one's relative error ("float_error", ...)."""
    rng = np.random.default_rng(rows + columns + bits)
    x = rng.standard_normal((tokens, columns)).astype(np.float32)
    scales = rng.uniform(0.01, 0.1, (rows, columns // group)).astype(np.float32)
    biases = rng.uniform(-1, 1, (rows, columns // group)).astype(np.float32)
    packed = PackedCodes.pack(rng.integers(0, 1 << bits, (rows, columns)), scales, biases, bits)
    want = x.astype(np.float64) @ packed.dense().astype(np.float64).T
    arms = {"float": segments_of([[packed]], int8=False), "int8": segments_of([[packed]], int8=True)}
    result = {}
    for name, segments in arms.items():  # compiled before the clock starts
        result[f"{name}_error"] = float(np.abs(packed_linear(x, segments) - want).max() / np.abs(want).max())
        result[name] = float("inf")
    for _ in range(rounds):  # the fastest call of each: on a shared machine the rest is others' load
        for name, segments in arms.items():
            for _ in range(repeat):
                start = time.perf_counter()
                packed_linear(x, segments)
                result[name] = min(result[name], time.perf_counter() - start)
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=1, help="input rows (8: a step of eight decoding requests)")
    args = ap.parse_args()
    vnni = "AVX-512 VNNI" if int8_dot.has_vnni() else "no VNNI: the portable vector form"
    print(
        f"threads {numba.get_num_threads()}; {vnni}; {args.tokens} input row(s); fastest call of each arm, interleaved"
    )
    for rows, columns, bits, group in SHAPES:
        r = measure(rows, columns, bits, args.repeat, args.rounds, group, args.tokens)
        print(
            f"{rows:6} x {columns:5} {bits} bits/{group:2}: "
            f"float {r['float'] * 1e6:7.0f} us (error {r['float_error']:.1e}), "
            f"int8 {r['int8'] * 1e6:7.0f} us (error {r['int8_error']:.1e}): {r['int8'] / r['float']:.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
