"""What a step of speculative windows costs on the CPU path: the decoder and the vocabulary projection
of the default model for R requests of T tokens each (one decode token plus T - 1 drafts).

    .venv/bin/python bench/window_cost.py [--context 400] [--shapes 1x1 1x3 1x5 1x8 8x1 8x3 8x5] [--repeats 11]

The marginal cost of a draft token against the cost of the step is what the draft planner weighs
(metalserve/spec_decode/cost.py). Pools are random: the cost does not depend on what they hold.
"""

from __future__ import annotations

import argparse

# isort: off
import metalserve  # noqa: F401  (must come before MLX: it loads the optimized BLAS that MLX then binds)

# isort: on
import numpy as np
from affine_linear import median_ms  # this folder's: the same timing as the codes-kernel bench
from metalserve.kernels.cpu.affine_linear import affine_linear

from metalserve.executor.host import paged_model
from metalserve.executor.host.compute import HostCompute
from metalserve.executor.models.families import kv_shape
from metalserve.kernels.cpu.decoder import decoder_layers
from metalserve.kernels.cpu.decoder_weights import NO_HOST_LORA
from metalserve.kernels.cpu.paged import CpuStepPlan
from metalserve.loader import load_model
from metalserve.platform import current_platform

BLOCK = 16


def step_ms(
    compute: HostCompute, pools: tuple[np.ndarray, ...], context: int, shape: str, repeats: int
) -> tuple[float, float]:
    """Median ms of the decoder and of the vocabulary projection for `shape` ("RxT")."""
    host, codes = compute.forward_on_host, compute.head_codes
    assert host is not None and codes is not None
    requests, tokens = (int(x) for x in shape.split("x"))
    blocks = pools[0].shape[2] // BLOCK
    positions = np.concatenate([np.arange(context - tokens, context)] * requests).astype(np.int32)
    tables = np.tile(np.arange(blocks, dtype=np.int32), (requests, 1))
    owners = np.repeat(np.arange(requests), tokens).astype(np.int32)
    plan = CpuStepPlan(positions.astype(np.int64), tables, owners, positions, BLOCK)
    rng = np.random.default_rng(requests * 100 + tokens)
    hidden = host.embedding[rng.integers(0, 1000, requests * tokens)]
    decoder = median_ms(
        lambda: decoder_layers(hidden.copy(), host.weights, host.shape, pools, plan, host.lora, NO_HOST_LORA), repeats
    )
    rows = rng.standard_normal((requests * tokens, hidden.shape[1])).astype(np.float32)
    head = median_ms(lambda: affine_linear(rows, codes), repeats)
    return decoder, head


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=400)
    parser.add_argument("--shapes", nargs="+", default=["1x1", "1x3", "1x5", "1x8", "8x1", "8x3", "8x5"])
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args()
    loaded = load_model(None)
    compute = paged_model(loaded, current_platform()).compute
    if not isinstance(compute, HostCompute) or compute.forward_on_host is None or compute.head_codes is None:
        raise SystemExit("the host forward does not apply here (MLX's CPU backend with the default model only)")
    blocks = args.context // BLOCK + 2
    rng = np.random.default_rng(0)
    kv = kv_shape(loaded)
    pools = tuple(
        rng.random((2, kv.num_kv_heads, blocks * BLOCK, kv.head_dim), dtype=np.float32) for _ in range(kv.num_layers)
    )
    print(f"context {args.context}\n\n| requests x tokens | decoder ms | head ms | step ms |\n|---|---|---|---|")
    for shape in args.shapes:
        decoder, head = step_ms(compute, pools, args.context, shape, args.repeats)
        print(f"| {shape} | {decoder:.1f} | {head:.1f} | {decoder + head:.1f} |", flush=True)


if __name__ == "__main__":
    main()
