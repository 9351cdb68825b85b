"""K/V bytes one layer's attention reads: the one-token (decode) kernel against the tiled kernel.

    python bench/kernel_traffic.py [--heads 9,3,64] [--dtype float16] [--exact]

Numbers come from the analytic model in metalserve/kernels/metal/traffic.py, which tests/kernels/test_traffic.py
checks against the emulator's exact per-buffer byte counts; `--exact` also emulates two small shapes
here and prints both counts (minutes on 2 cores). "minimum" is the issue's: every K/V byte a query tile
needs, read once per tile; "floor" is every K/V byte a request needs, read once per request.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from metalserve.kernels.metal.paged import PagedArgs, choose_kernel, run_paged_attention  # noqa: E402
from metalserve.kernels.metal.tiled import tiling  # noqa: E402
from metalserve.kernels.metal.traffic import Heads, kv_bytes  # noqa: E402

Reqs = tuple[tuple[int, int], ...]


def shapes() -> list[tuple[str, Reqs]]:
    """(label, requests as (new query tokens, total KV length))."""
    out: list[tuple[str, Reqs]] = []
    for n in (512, 4096, 16384):
        out.append((f"prefill {n}", ((n, n),)))
        out.append((f"prefill {n} on {n} cached", ((n, 2 * n),)))
    for batch in (1, 8, 32):
        for ctx in (1024, 32768):
            out.append((f"decode b{batch} ctx{ctx // 1024}K", ((1, ctx),) * batch))
    return out


def auto_kernel(reqs: Reqs, heads: Heads) -> str:
    """What the entry point would launch for this batch (shapes only, tiny stand-in arrays)."""
    q = mx.zeros((sum(q for q, _ in reqs), heads.num_q_heads, heads.head_dim))
    pool = mx.zeros((16, heads.num_kv_heads, heads.head_dim))
    cu = mx.array(np.cumsum([0] + [q for q, _ in reqs]).astype(np.int32))
    lens = mx.array([kv for _, kv in reqs], dtype=mx.int32)
    args = PagedArgs(q, pool, pool, mx.zeros((len(reqs), 1), mx.int32), cu, lens, 16, 1.0, None, None, None)
    return choose_kernel(args, "auto", None)


def gib(n: int) -> str:
    return f"{n / 2**30:9.3f}" if n >= 2**28 else f"{n / 2**20:8.1f}M"


def report(heads: Heads) -> None:
    t = tiling(heads.group, heads.head_dim)
    print(
        f"Hq={heads.num_q_heads} Hkv={heads.num_kv_heads} D={heads.head_dim} {heads.itemsize}-byte K/V; "
        f"tiled kernel: {t.tile_q if t else '-'} tokens x {heads.group} heads per tile; bytes per layer "
        "(GiB, or M = MiB)"
    )
    print(
        f"{'shape':28s} {'old':>10s} {'new':>10s} {'kernel':>7s} {'old/new':>8s} {'minimum':>10s} "
        f"{'new/min':>8s} {'floor':>10s}"
    )
    for label, reqs in shapes():
        old = kv_bytes(reqs, heads, "decode")
        kernel = auto_kernel(reqs, heads)
        new = kv_bytes(reqs, heads, kernel)
        minimum = kv_bytes(reqs, heads, "tiled")
        floor = kv_bytes(reqs, heads, "once")
        print(
            f"{label:28s} {gib(old):>10s} {gib(new):>10s} {kernel:>7s} {old / new:8.2f} {gib(minimum):>10s} "
            f"{new / minimum:8.2f} {gib(floor):>10s}"
        )


def exact(heads: Heads, dtype: mx.Dtype) -> None:
    """Emulate a 512-token prefill and a decode batch of 8 at 1K and compare with the model."""
    from tools.msl_emulator import emulate_counted

    rng = np.random.default_rng(0)
    for label, reqs in (("prefill 512", ((512, 512),)), ("decode b8 ctx1K", ((1, 1024),) * 8)):
        blocks = [-(-kv // 16) for _, kv in reqs]
        table = np.zeros((len(reqs), max(blocks)), np.int32)
        ids = rng.permutation(sum(blocks))
        for i, n in enumerate(blocks):
            table[i, :n] = ids[sum(blocks[:i]) : sum(blocks[:i]) + n]
        pool = mx.array(rng.standard_normal((sum(blocks) * 16, heads.num_kv_heads, heads.head_dim))).astype(dtype)
        q = mx.array(rng.standard_normal((sum(q for q, _ in reqs), heads.num_q_heads, heads.head_dim))).astype(dtype)
        cu = mx.array(np.cumsum([0] + [q for q, _ in reqs]).astype(np.int32))
        lens = mx.array([kv for _, kv in reqs], dtype=mx.int32)
        args = PagedArgs(q, pool, pool, mx.array(table), cu, lens, 16, heads.head_dim**-0.5, None, None, None)
        for kernel in ("decode", "tiled"):
            seen: list[int] = []

            def execute(launch, seen=seen):  # type: ignore[no-untyped-def]
                outputs, counts = emulate_counted(launch)
                seen.append(counts.bytes_read.get("k_pool", 0) + counts.bytes_read.get("v_pool", 0))
                return outputs

            run_paged_attention(args, execute, None, kernel)
            model = kv_bytes(reqs, heads, kernel)
            print(f"exact {label:18s} {kernel:7s} emulated {sum(seen):>12d}  model {model:>12d}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head dim (default: SmolLM2)")
    parser.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    parser.add_argument("--exact", action="store_true", help="also count two small shapes by emulation")
    args = parser.parse_args()
    hq, hkv, d = (int(v) for v in args.heads.split(","))
    dtype = getattr(mx, args.dtype)
    heads = Heads(hq, hkv, d, dtype.size)
    report(heads)
    if args.exact:
        exact(heads, dtype)


if __name__ == "__main__":
    main()
