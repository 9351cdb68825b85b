"""Micro-benchmark of the paged-attention kernels against MLX's dense SDPA on a gathered copy of the KV.

    python bench/kernel_attention.py [--iters 20] [--shapes all|small]

On a Mac it times, per shape: the tiled and the decode Metal kernels over the pages (and which one the
entry point picks); `mx.fast.scaled_dot_product_attention` on a dense copy of the same KV (the copy
made beforehand, so this is SDPA alone); and gather + SDPA. Elsewhere the Metal rows are skipped, the
portable path (executor/attention/mlx_ops.py) is timed instead, and only the small shapes run unless `--shapes all`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

# isort: off
import metalserve  # noqa: F401  (must come before MLX: it loads the optimized BLAS that MLX then binds)

# isort: on
import mlx.core as mx
import numpy as np

from metalserve.executor.attention import mlx_ops
from metalserve.kernels.metal.gpu import metal_paged_attention
from metalserve.kernels.metal.paged import PagedArgs, choose_kernel

# (label, num_reqs, q_len per request, context length); SmolLM2-like heads: 9 query, 3 KV, dim 64.
SHAPES = (
    ("prefill 512", 1, 512, 512),
    ("prefill 4K", 1, 4096, 4096),
    ("prefill 16K", 1, 16384, 16384),
    *((f"decode b{b} ctx{c // 1024}K", b, 1, c) for b in (1, 8, 32) for c in (1024, 8192, 32768)),
)
SMALL = ("prefill 512", "decode b1 ctx1K", "decode b8 ctx1K")  # what the CPU fallback times by default
HQ, HKV, D, BLOCK = 9, 3, 64, 16


def timed(fn: Callable[[], mx.array], iters: int) -> float:
    """Median milliseconds of `fn` with its result evaluated, after two warm-up calls."""
    for _ in range(2):
        mx.eval(fn())
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        mx.eval(fn())
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def bench_shape(num_reqs: int, q_len: int, ctx: int, iters: int, dtype: mx.Dtype) -> dict[str, float]:
    rng = np.random.default_rng(0)
    blocks = ctx // BLOCK
    table = rng.permutation(num_reqs * blocks).reshape(num_reqs, blocks).astype(np.int32)
    pool = (num_reqs * blocks * BLOCK, HKV, D)
    k_pool = mx.array(rng.standard_normal(pool).astype(np.float32)).astype(dtype)
    v_pool = mx.array(rng.standard_normal(pool).astype(np.float32)).astype(dtype)
    q = mx.array(rng.standard_normal((num_reqs * q_len, HQ, D)).astype(np.float32)).astype(dtype)
    cu = mx.array(np.arange(num_reqs + 1, dtype=np.int32) * q_len)
    lens = mx.array(np.full(num_reqs, ctx, np.int32))
    bt = mx.array(table)
    slots = mx.array((table[:, :, None] * BLOCK + np.arange(BLOCK)).reshape(num_reqs, ctx))
    scale = D**-0.5
    qd = q.reshape(num_reqs, q_len, HQ, D).transpose(0, 2, 1, 3)
    mask = "causal" if q_len > 1 else None

    def gathered_sdpa() -> mx.array:
        k = k_pool[slots].transpose(0, 2, 1, 3)
        v = v_pool[slots].transpose(0, 2, 1, 3)
        return mx.fast.scaled_dot_product_attention(qd, k, v, scale=scale, mask=mask)

    kd, vd = k_pool[slots].transpose(0, 2, 1, 3), v_pool[slots].transpose(0, 2, 1, 3)
    mx.eval(kd, vd)
    rows = {
        "sdpa (dense copy)": timed(
            lambda: mx.fast.scaled_dot_product_attention(qd, kd, vd, scale=scale, mask=mask), iters
        ),
        "gather + sdpa": timed(gathered_sdpa, iters),
    }
    args = (q, k_pool, v_pool, bt, cu, lens)
    picks = choose_kernel(PagedArgs(*args, BLOCK, scale, None, None, None), "auto", None)
    print(f"  (the entry point picks the {picks} kernel)")
    if mx.metal.is_available():
        for name in ("tiled", "decode"):
            rows[f"metal {name}"] = timed(
                lambda name=name: metal_paged_attention(*args, block_size=BLOCK, scale=scale, kernel=name), iters
            )
    else:
        portable = mlx_ops.paged_attention
        rows["mlx_ops.py"] = timed(lambda: portable(*args, block_size=BLOCK, scale=scale), iters)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    parser.add_argument(
        "--shapes", choices=["all", "small"], default=None, help="default: all on Metal, small elsewhere"
    )
    args = parser.parse_args()
    dtype = getattr(mx, args.dtype)
    small = (args.shapes or ("all" if mx.metal.is_available() else "small")) == "small"
    print(
        f"device: {'Metal' if mx.metal.is_available() else 'CPU (no Metal: kernel rows skipped)'}, "
        f"{args.dtype}, Hq={HQ} Hkv={HKV} D={D} block={BLOCK}; median ms of {args.iters}"
    )
    for label, num_reqs, q_len, ctx in SHAPES:
        if small and label not in SMALL:
            continue
        rows = bench_shape(num_reqs, q_len, ctx, args.iters, dtype)
        print(f"{label:22s} " + "  ".join(f"{k}: {v:8.3f}" for k, v in rows.items()))


if __name__ == "__main__":
    main()
