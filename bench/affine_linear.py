"""The default model's projections on MLX's CPU backend: MLX's fp32 matmul (MKL) vs the packed-codes kernel.

    .venv/bin/python bench/affine_linear.py [--model PATH] [--batches 1 8 32 64 128 256] [--repeats 5]

Why small steps on the CPU path read the stored 4-bit codes (metalserve/executor/host/linear.py).
Every run multiplies one `[batch, in]` input by all of the model's layer projections (qkv, o, gate+up,
down), one after the other, as a decode step does; the two sides alternate in one process and the
median of `--repeats` runs is printed, with the ratio.
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

from metalserve.executor.host.compute import HostCompute
from metalserve.executor.host.linear import HostLinear
from metalserve.executor.models.adapter import PagedModel
from metalserve.kernels.cpu.packed_linear import packed_linear
from metalserve.loader import load_model


def projections(paged: PagedModel) -> list[HostLinear]:
    found = []
    for layer in paged.backbone.layers:
        for owner, name in [
            (layer.self_attn, "qkv_proj"),
            (layer.self_attn.inner, "o_proj"),
            (layer.mlp, "gate_up_proj"),
            (layer.mlp.inner, "down_proj"),
        ]:
            module = getattr(owner, name, None)
            if isinstance(module, HostLinear):
                found.append(module)
    return found


def median_ms(fn: Callable[[], None], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    loaded = load_model(args.model, weights="dequantize")  # MLX's side needs its fp32 copy
    layers = projections(PagedModel(loaded.model, loaded.model_type, HostCompute(loaded.codes)))
    if not layers:
        raise SystemExit("no projection kept its codes (is this a Q4/Q8 model, dequantized on MLX's CPU backend?)")
    weights = sum(p.shape[0] * p.columns for layer in layers for p in layer.codes)
    packed = sum(p.nbytes for layer in layers for p in layer.codes)
    print(
        f"{len(layers)} projections, {weights / 1e6:.0f}M weights: fp32 {4 * weights / 1e6:.0f} MB, "
        f"packed codes {packed / 1e6:.0f} MB\n"
    )
    print("| batch | MLX fp32 (ms) | codes kernel (ms) | MLX / codes |\n|---|---|---|---|")
    for batch in args.batches:
        a, b = compare(layers, batch, args.repeats)
        print(f"| {batch} | {a:.1f} | {b:.1f} | {a / b:.2f}x |", flush=True)


def compare(layers: list[HostLinear], batch: int, repeats: int) -> tuple[float, float]:
    """Median ms of one pass over `layers` through MLX and through the codes kernel, alternated."""
    rng = np.random.default_rng(batch)
    widths = {layer.codes[0].columns for layer in layers}
    inputs = {w: rng.standard_normal((batch, w)).astype(np.float32) for w in widths}
    as_mx = {w: mx.array(x) for w, x in inputs.items()}
    mx.eval(list(as_mx.values()))

    def with_mlx() -> None:
        for layer in layers:
            mx.eval(layer.inner(as_mx[layer.codes[0].columns]))

    def with_codes() -> None:
        for layer in layers:
            packed_linear(inputs[layer.codes[0].columns], layer.code_parts.segments())

    mlx_ms, codes_ms = [], []
    for _ in range(2):  # alternate, so drift on a shared machine hits both sides
        mlx_ms.append(median_ms(with_mlx, repeats))
        codes_ms.append(median_ms(with_codes, repeats))
    return statistics.median(mlx_ms), statistics.median(codes_ms)


if __name__ == "__main__":
    main()
