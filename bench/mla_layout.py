"""MLA page layouts compared: the latent (vLLM's MLA layout, what metalserve keeps) against expanded K/V.

    python bench/mla_layout.py [--iters 10] [--batch 8] [--contexts 1024,4096]

One attention layer of a DeepSeek-V2-Lite-sized MLA (16 heads, kv_lora 512, rope 64, nope 128, v 128),
a decode step of `--batch` requests at each context length, through the real backends (MLX ops and the
numba CPU kernel). Latent: one KV head of 576 channels per token, queries absorbed through kv_b's K half
and the output un-absorbed through its V half (both timed with the attention). Expanded: per-head K
(192) and V (128, padded to K's width as the seam's two-plane pool stores it) attended as plain MHA.
Prints bytes per token and layer and the median milliseconds of one decode step's attention; then, for
a fresh prompt's prefill chunk of each `--prefills` length (MLX's causal SDPA over the chunk itself), the
absorbed form against mlx-lm's own prefill form (the latent expanded to per-head K/V first).
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

from metalserve.executor.attention.base import AttentionBackend, AttentionCall, AttentionOptions, LayerCacheSpec
from metalserve.executor.attention.cpu import CpuAttention
from metalserve.executor.attention.mlx import MlxAttention
from metalserve.executor.step_inputs import StepInputs
from metalserve.kvcache.specs import MLALatent

HEADS, RANK, ROPE, NOPE, V, BLOCK = 16, 512, 64, 128, 128, 16


def decode_step(batch: int, context: int) -> StepInputs:
    """`batch` requests, one new token each at position `context - 1`, pages laid out one after another."""
    pages = -(-context // BLOCK)
    rows = [np.arange(1 + r * pages, 1 + (r + 1) * pages, dtype=np.int32) for r in range(batch)]
    pos = context - 1
    slots = np.array([row[pos // BLOCK] * BLOCK + pos % BLOCK for row in rows], np.int32)
    return StepInputs(
        [f"r{r}" for r in range(batch)],
        np.zeros(batch, np.int32),
        np.full(batch, pos, np.int32),
        slots,
        np.arange(batch + 1, dtype=np.int32),
        np.full(batch, context, np.int32),
        rows,
        [],
        np.zeros(0, np.int32),
    )


def timed(fn: Callable[[], mx.array], iters: int) -> float:
    for _ in range(2):
        mx.eval(fn())
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        mx.eval(fn())
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def latent_step(backend: AttentionBackend, batch: int, context: int) -> Callable[[], mx.array]:  # type: ignore[type-arg]
    step = decode_step(batch, context)
    latent = MLALatent(num_kv_heads=1, head_dim=RANK + ROPE, value_dim=RANK)
    spec = LayerCacheSpec(latent, BLOCK, batch * -(-context // BLOCK) + 1)
    cache, meta = backend.allocate(spec), backend.build_metadata(step, spec)
    embed_q = mx.random.normal((HEADS, RANK, NOPE)) * 0.05
    unembed = mx.random.normal((HEADS, V, RANK)) * 0.05
    q_nope, q_pe = mx.random.normal((batch, HEADS, NOPE)), mx.random.normal((batch, HEADS, ROPE))
    k = mx.random.normal((batch, 1, RANK + ROPE))
    opts, slots = AttentionOptions(scale=(NOPE + ROPE) ** -0.5, value_dim=RANK), mx.array(step.slot_mapping)
    mx.eval(embed_q, unembed, q_nope, q_pe, k)

    def run() -> mx.array:
        q = mx.concatenate([(q_nope.swapaxes(0, 1) @ embed_q.swapaxes(-1, -2)).swapaxes(0, 1), q_pe], axis=-1)
        out = backend.forward(AttentionCall(q, k, None, slots, cache, meta, opts))
        return out.swapaxes(0, 1) @ unembed.swapaxes(-1, -2)

    return run


def expanded_step(backend: AttentionBackend, batch: int, context: int) -> Callable[[], mx.array]:  # type: ignore[type-arg]
    step = decode_step(batch, context)
    width = NOPE + ROPE
    spec = LayerCacheSpec.dense(HEADS, width, mx.float32, BLOCK, batch * -(-context // BLOCK) + 1)
    cache, meta = backend.allocate(spec), backend.build_metadata(step, spec)
    q, k, v = (mx.random.normal((batch, HEADS, width)) for _ in range(3))
    opts, slots = AttentionOptions(scale=width**-0.5), mx.array(step.slot_mapping)
    mx.eval(q, k, v)
    return lambda: backend.forward(AttentionCall(q, k, v, slots, cache, meta, opts))


def prefill_pair(tokens: int) -> tuple[Callable[[], mx.array], Callable[[], mx.array]]:
    """The absorbed and the expanded form of one chunk's causal attention over its own latent."""
    q = mx.random.normal((1, HEADS, tokens, RANK + ROPE))
    q_expanded = mx.random.normal((1, HEADS, tokens, NOPE + ROPE))
    latent = mx.random.normal((1, 1, tokens, RANK + ROPE))
    embed_q, unembed = mx.random.normal((HEADS, RANK, NOPE)) * 0.05, mx.random.normal((HEADS, V, RANK)) * 0.05
    mx.eval(q, q_expanded, latent, embed_q, unembed)
    scale = (NOPE + ROPE) ** -0.5

    def absorbed() -> mx.array:
        return mx.fast.scaled_dot_product_attention(q, latent, latent[..., :RANK], scale=scale, mask="causal")

    def expanded() -> mx.array:
        rope = mx.broadcast_to(latent[..., RANK:], (1, HEADS, tokens, ROPE))
        k = mx.concatenate([latent[..., :RANK] @ embed_q, rope], axis=-1)
        v = latent[..., :RANK] @ unembed.swapaxes(-1, -2)
        return mx.fast.scaled_dot_product_attention(q_expanded, k, v, scale=scale, mask="causal")

    return absorbed, expanded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--contexts", default="1024,4096")
    parser.add_argument("--prefills", default="512,2048")
    args = parser.parse_args()
    latent, expanded, padded = (RANK + ROPE) * 4, HEADS * (NOPE + ROPE + V) * 4, HEADS * 2 * (NOPE + ROPE) * 4
    ratio = expanded / latent
    print(f"fp32 bytes per token and layer: latent {latent}, expanded {expanded} ({ratio:.1f}x; {padded} padded)")
    for name, backend in (("mlx", MlxAttention()), ("cpu", CpuAttention())):
        for context in (int(c) for c in args.contexts.split(",")):
            lat = timed(latent_step(backend, args.batch, context), args.iters)
            exp = timed(expanded_step(backend, args.batch, context), args.iters)
            print(f"{name:>3} decode b{args.batch} ctx {context:>5}: latent {lat:7.2f} ms, expanded {exp:7.2f} ms")
    for tokens in (int(t) for t in args.prefills.split(",")):
        absorbed, expanded = (timed(fn, args.iters) for fn in prefill_pair(tokens))
        print(f"mlx prefill {tokens:>5} tokens: absorbed {absorbed:8.1f} ms, expanded {expanded:8.1f} ms")


if __name__ == "__main__":
    main()
