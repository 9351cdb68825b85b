"""Dequantization speed of GGUF tensor types on a 4096x4096 tensor, one thread: gguf's dequantizer on
the whole tensor, gguf's on chunks of 16 rows, and metalserve's loader (gguf_dequant.dequantize_numpy:
row chunks, and gguf_kquants.py's own code for Q6_K), checked equal bit for bit; for Q4_K,
Q5_K, Q5_0 and Q5_1 also their repacking into MLX's affine layout (what the loader does with those
matrices; MB/s of fp32 equivalent).
MB/s (of CPU time) counts fp32 output; "in" counts the file's bytes. K-quant tensors are random valid blocks.
Run by hand:  .venv/bin/python bench/gguf_dequant.py [--repeats 5] [--types Q4_K Q6_K]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from metalserve.loader.gguf_affine import AFFINE  # noqa: E402
from metalserve.loader.gguf_dequant import affine_numpy, dequantize_numpy  # noqa: E402
from tests.loader.gguf_blocks import K_QUANTS, random_k_blocks  # noqa: E402

T = gguf.GGMLQuantizationType
N = 4096


def best(f: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.process_time()  # CPU time: the shared machines' wall clock is too noisy
        f()
        times.append(time.process_time() - t0)
    return min(times)


def encoded(kind: T, rng: np.random.Generator) -> np.ndarray:
    if kind in K_QUANTS:
        return random_k_blocks((N, N), kind, rng)
    return np.asarray(gguf.quants.quantize(rng.standard_normal((N, N), dtype=np.float32), kind))


def measure(name: str, data: np.ndarray, repeats: int) -> str:
    kind = T[name]
    raw = data.view(np.uint8).reshape(-1)
    chunks = [data[i : i + 16] for i in range(0, N, 16)]
    whole = best(lambda: gguf.quants.dequantize(data, kind), repeats)
    chunked = best(lambda: [gguf.quants.dequantize(c, kind) for c in chunks], repeats)
    ours = best(lambda: dequantize_numpy(raw, name, (N, N)), repeats)
    assert np.array_equal(dequantize_numpy(raw, name, (N, N)), gguf.quants.dequantize(data, kind))
    timings = [("gguf whole", whole), ("gguf 16-row chunks", chunked), ("metalserve", ours)]
    if name in AFFINE:  # what the loader really does with these: repack into MLX's affine layout
        timings.append(("metalserve affine", best(lambda: affine_numpy(raw, name, (N, N)), repeats)))
    out_mb = N * N * 4 / 1e6
    return ", ".join(f"{label} {out_mb / t:5.0f} MB/s (in {data.nbytes / 1e6 / t:4.0f})" for label, t in timings)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--types", nargs="*", default=["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "Q8_0"])
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    for name in args.types:
        print(f"{name}: {measure(name, encoded(T[name], rng), args.repeats)}")


if __name__ == "__main__":
    main()
