"""Two local tensor-parallel ranks on MLX's ring backend: the bytes all-reduced per step and their share
of the step's time, measured; then the same counts for an 8B and a 70B llama (counted on small-width
random models with the real layer counts, scaled by width) in a step-time model of two Macs joined by
Thunderbolt 5, with every assumption printed beside it.

    .venv/bin/python bench/tensor_parallel.py [--hidden 1024] [--layers 8] [--batches 1 8 32] [--steps 8]

It starts rank 1 itself (this script again, with MLX_RANK=1). Both ranks build the same random llama
(mlx-lm's classes, one seed), split it with metalserve's `shard_model`, and run paged decode steps of
`batch` requests at `context` tokens the way a tensor-parallel step runs (distributed/tensor.py): the
step's inputs broadcast from rank 0, then the forward with two all-reduces per layer. Two arms per
batch, alternating step by step: "TP" (as served) and "no comm" (each rank's same half of the compute,
every all-reduce and the broadcast left out, so its output is wrong but its arithmetic is the same).
The all-reduce share of a step is (TP - no comm) / TP.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from typing import Any

# isort: off
import metalserve  # noqa: F401  (must come before MLX: it loads the optimized BLAS that MLX then binds)

# isort: on
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import llama

from metalserve.distributed.launch import init_group, write_local_hostfile
from metalserve.distributed.shard import METER, AllSum, shard_model
from metalserve.distributed.stage import Stage
from metalserve.distributed.tensor import decode_step, encode_step, receive_step, send_step
from metalserve.distributed.wire import Header, Kind, StepMeta
from metalserve.executor.attention.mlx import MlxAttention
from metalserve.executor.context import forward_context
from metalserve.executor.models.adapter import PagedModel
from metalserve.executor.models.families import model_family
from metalserve.executor.step_inputs import StepInputs
from metalserve.kvcache.specs import KVCacheDtype

BLOCK = 16
SMALL_WIDTH = 64  # the counting models' hidden size (4 heads of 16)
CONFIGS = {  # name: (hidden, layers, parameters in billions), Llama 3's shapes
    "8B": (4096, 32, 8.0),
    "70B": (8192, 80, 70.6),
}


def random_llama(hidden: int, layers: int, heads: int, kv_heads: int, inter: int, vocab: int) -> nn.Module:
    mx.random.seed(0)
    args = llama.ModelArgs.from_dict(
        dict(
            model_type="llama",
            hidden_size=hidden,
            num_hidden_layers=layers,
            intermediate_size=inter,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            rms_norm_eps=1e-5,
            vocab_size=vocab,
            rope_theta=10000.0,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
        )
    )
    return llama.Model(args)


def decode_inputs(batch: int, context: int) -> StepInputs:
    """`batch` requests with one query each at position context-1, each on its own blocks."""
    per = -(-context // BLOCK)
    rows = [np.arange(i * per, (i + 1) * per) for i in range(batch)]
    pos = np.full(batch, context - 1, np.int32)
    slots = np.array([r[-1] * BLOCK + (context - 1) % BLOCK for r in rows], np.int32)
    meta = StepMeta(
        pos, slots, np.arange(batch + 1, dtype=np.int32), np.full(batch, context, np.int32), rows, np.arange(batch)
    )
    step = meta.step_inputs()
    step.token_ids = (np.arange(batch, dtype=np.int32) * 7 + 5) % 1000
    return step


def no_comm_copy(model: nn.Module) -> None:
    """Every all-reduce replaced by this rank's partial sum alone (the "no comm" arm)."""
    for layer in model.model.layers:
        for owner, name in ((layer.self_attn, "o_proj"), (layer.mlp, "down_proj")):
            reduce = getattr(owner, name)
            if isinstance(reduce, AllSum):
                setattr(owner, name, reduce.inner)


def paged(model: nn.Module, num_blocks: int) -> tuple[PagedModel, Stage]:
    pm = PagedModel(model, "llama")
    spec = model_family("llama").kv_cache_spec(model, BLOCK, KVCacheDtype.AUTO, num_blocks)
    return pm, Stage(pm, spec, MlxAttention())


def tp_step(pm: PagedModel, stage: Stage, step: StepInputs | None, group: mx.distributed.Group | None) -> float:
    """One step as a tensor-parallel rank runs it; `group` None: the no-comm arm (no broadcast)."""
    t0 = time.perf_counter()
    if group is not None:
        if group.rank() == 0:
            assert step is not None
            flat, width = encode_step(step)
            n, r, rows = len(step.token_ids), len(step.request_ids), len(step.logits_indices)
            header = Header(Kind.STEP, n, r, rows, width, 0, 0, flat.nbytes)
            send_step(header, flat, group)
        else:
            header, flat = receive_step(group)
            token_ids, meta = decode_step(flat, header)
    if step is not None:
        token_ids, meta = np.asarray(step.token_ids, np.int32), StepMeta.from_step(step)
    with forward_context(stage.context(meta)):
        hidden = pm.mlx_hidden_states(mx.array(token_ids))
    mx.eval(hidden, stage.pools())
    return time.perf_counter() - t0


def measure(
    args: argparse.Namespace, group: mx.distributed.Group
) -> list[tuple[int, list[float], list[float], int, int]]:
    """Per batch: (batch, TP step seconds, no-comm step seconds, all-reduces per step, bytes all-reduced
    per step)."""
    shape = (args.hidden, args.layers, args.heads, args.kv_heads, args.inter, 32000)
    blocks = max(args.batches) * -(-args.context // BLOCK) + 1
    tp_model, alone = random_llama(*shape), random_llama(*shape)
    shard_model(tp_model, group)
    shard_model(alone, group)
    no_comm_copy(alone)
    tp_pm, tp_stage = paged(tp_model, blocks)
    alone_pm, alone_stage = paged(alone, blocks)
    rows = []
    for batch in args.batches:
        step = decode_inputs(batch, args.context)
        tp_s, alone_s = [], []
        for i in range(args.steps + 2):  # two warm-up steps per arm, not kept
            METER.reset()
            t = tp_step(tp_pm, tp_stage, step, group)
            calls, moved = METER.calls, METER.bytes
            a = tp_step(alone_pm, alone_stage, step, None)
            if i >= 2:
                tp_s.append(t)
                alone_s.append(a)
        rows.append((batch, tp_s, alone_s, calls, moved))
    return rows


def count_bytes(layers: int, tokens: int, group: mx.distributed.Group) -> tuple[int, int]:
    """(all-reduces, bytes) of one step of `tokens` through a width-64 llama of `layers` layers at TP 2."""
    model = random_llama(SMALL_WIDTH, layers, 4, 2, 128, 512)
    shard_model(model, group)
    pm, stage = paged(model, tokens // BLOCK + 2)
    step = decode_inputs(1, tokens)
    step.positions = np.arange(tokens, dtype=np.int32)  # one request's prompt of `tokens` tokens
    step.slot_mapping = np.arange(tokens, dtype=np.int32)
    step.cu_seqlens_q = np.array([0, tokens], np.int32)
    step.token_ids = np.arange(tokens, dtype=np.int32) % 500
    step.block_rows = [np.arange(-(-tokens // BLOCK))]
    METER.reset()
    with forward_context(stage.context(step)):
        mx.eval(pm.mlx_hidden_states(mx.array(step.token_ids)))
    return METER.calls, METER.bytes


def local_latency(group: mx.distributed.Group, nbytes: int, rounds: int = 50) -> float:
    """Median seconds of one all-reduce of `nbytes` over the local ring."""
    x = mx.ones((max(1, nbytes // 4),), mx.float32)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        mx.eval(mx.distributed.all_sum(x, group=group))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    args = parse_args()
    child = None
    if "MLX_RANK" not in os.environ:
        os.environ.update(MLX_HOSTFILE=write_local_hostfile(2), MLX_RANK="0")
        child = subprocess.Popen([sys.executable, *sys.argv], env={**os.environ, "MLX_RANK": "1"})
    group = init_group(2, "--tensor-parallel-size")
    rows = measure(args, group)
    counts = {
        name: count_bytes(layers, t, group) for name, (_, layers, _) in CONFIGS.items() for t in [args.count_tokens]
    }
    latency = {n: local_latency(group, n) for n in (4096, 1 << 20)}
    if group.rank() == 0:
        report(args, rows, counts, latency)
    if child is not None:
        child.wait(120)
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--inter", type=int, default=2816)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--count-tokens", type=int, default=16, help="tokens of the counting step")
    g = parser.add_argument_group("the Thunderbolt 5 model (assumptions)")
    g.add_argument("--link-gbit", type=float, default=80.0, help="link rate, Gbit/s (Thunderbolt 5: 80)")
    g.add_argument("--rdma-efficiency", type=float, default=0.8, help="share of the link JACCL (RDMA) reaches")
    g.add_argument("--rdma-latency-us", type=float, default=10.0, help="one all-reduce's fixed cost over RDMA")
    g.add_argument("--tcp-efficiency", type=float, default=0.6, help="share of the link the ring (TCP) reaches")
    g.add_argument("--tcp-latency-us", type=float, default=50.0, help="one all-reduce's fixed cost over TCP")
    g.add_argument("--mac-gbs", type=float, default=546.0, help="memory bandwidth per Mac, GB/s (M4 Max: 546)")
    g.add_argument("--mac-tflops", type=float, default=15.0, help="effective fp16 TFLOP/s per Mac GPU")
    g.add_argument("--weight-bytes", type=float, default=0.5625, help="bytes per parameter (4-bit + scales)")
    g.add_argument("--act-bytes", type=int, default=2, help="bytes per activation all-reduced (fp16/bf16)")
    return parser.parse_args()


def report(
    args: argparse.Namespace, rows: list[Any], counts: dict[str, tuple[int, int]], lat: dict[int, float]
) -> None:
    print(
        f"measured: 2 local ranks (ring backend over loopback), random llama hidden {args.hidden}, {args.layers} "
        f"layers, {args.heads} heads / {args.kv_heads} KV heads, MLP {args.inter}, fp32; decode steps at "
        f"context {args.context}; {args.steps} steps per arm, arms alternating; on a shared machine the "
        "minimum is the steadier figure"
    )
    print(
        "batch | all-reduces/step | bytes all-reduced/step (per rank) | TP ms median (min) | no-comm ms median "
        "(min) | all-reduce share of medians (of mins)"
    )
    for batch, tp_s, alone_s, calls, moved in rows:
        tp, alone = statistics.median(tp_s), statistics.median(alone_s)
        tp_min, alone_min = min(tp_s), min(alone_s)
        cells = f"{1e3 * tp:.2f} ({1e3 * tp_min:.2f}) | {1e3 * alone:.2f} ({1e3 * alone_min:.2f})"
        shares = f"{(tp - alone) / tp:.1%} ({(tp_min - alone_min) / tp_min:.1%})"
        print(f"{batch:5d} | {calls:16d} | {moved:33d} | {cells} | {shares}")
    print(f"local ring: one all-reduce of 4 KiB {1e6 * lat[4096]:.0f} us, of 1 MiB {1e6 * lat[1 << 20]:.0f} us")
    estimate(args, counts)


def estimate(args: argparse.Namespace, counts: dict[str, tuple[int, int]]) -> None:
    t = args.count_tokens
    print(
        f"\nStep-time model, TP 2 over two Macs and Thunderbolt 5. Counted: one step of {t} tokens through a "
        f"random llama of width {SMALL_WIDTH} with the real layer count at TP 2 (fp32), scaled by width and "
        f"by {args.act_bytes}/4 for fp16 activations and by tokens. Assumed: each Mac reads its half of the "
        f"weights ({args.weight_bytes} bytes/parameter) at {args.mac_gbs:.0f} GB/s or computes its half of "
        f"2 FLOPs/parameter/token at {args.mac_tflops:.0f} TFLOP/s, whichever is longer; an all-reduce of B "
        f"bytes at TP 2 moves B each way (ring: 2(N-1)/N x B) over a {args.link_gbit:.0f} Gbit/s link, at "
        f"{args.rdma_efficiency:.0%} + {args.rdma_latency_us:.0f} us (JACCL, RDMA) or "
        f"{args.tcp_efficiency:.0%} + {args.tcp_latency_us:.0f} us (ring, TCP); compute and transfer do not "
        "overlap (each all-reduce waits for its layer)."
    )
    print("model | tokens/step | all-reduces | bytes/step | compute ms | RDMA ms (share) | TCP ms (share)")
    for name, (hidden, _, params_b) in CONFIGS.items():
        calls, counted = counts[name]
        per_token = counted / t * hidden / SMALL_WIDTH * args.act_bytes / 4
        for tokens in (1, 8, 32, 512):
            moved = per_token * tokens
            read = params_b * 1e9 * args.weight_bytes / 2 / (args.mac_gbs * 1e9)
            flops = tokens * 2 * params_b * 1e9 / 2 / (args.mac_tflops * 1e12)
            compute = max(read, flops)
            cells = []
            for eff, lat_us in (
                (args.rdma_efficiency, args.rdma_latency_us),
                (args.tcp_efficiency, args.tcp_latency_us),
            ):
                comm = calls * lat_us * 1e-6 + moved / (args.link_gbit / 8 * 1e9 * eff)
                cells.append(f"{1e3 * comm:7.2f} ({comm / (comm + compute):.0%})")
            print(
                f"{name:5s} | {tokens:11d} | {calls:11d} | {moved:10.0f} | {1e3 * compute:10.2f} | {' | '.join(cells)}"
            )


if __name__ == "__main__":
    sys.exit(main())
