"""Two local pipeline ranks on MLX's ring backend: per decode step, the bytes moved between the ranks
and the time in transfers against compute, at batch 1, 8 and 32; then the expected throughput on two
Macs joined by Thunderbolt 5, from those figures and the assumptions printed with it.

    .venv/bin/python bench/pipeline.py [--model PATH] [--batches 1 8 32] [--context 256] [--steps 8]

It starts rank 1 itself (this script again, with MLX_RANK=1) and drives both stages directly with
decode steps of `batch` requests at `context` tokens each (no scheduler: only the pipe is measured).
Rank 0 = embedding + its layers + final norm + vocabulary projection + argmax; rank 1 = the other layers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

# isort: off
import metalserve  # noqa: F401  (must come before MLX: it loads the optimized BLAS that MLX then binds)

# isort: on
import mlx.core as mx
import numpy as np

from metalserve.distributed.launch import init_group, write_local_hostfile
from metalserve.distributed.partition import split_layers
from metalserve.distributed.stage import Stage, keep_layers, layer_bytes, non_layer_bytes, run_layers
from metalserve.distributed.wire import (
    HEADER_LEN,
    Header,
    Kind,
    StepMeta,
    as_hidden,
    pack_payload,
    recv_header,
    recv_payload,
    send_message,
    split_payload,
)
from metalserve.executor.attention.select import select_attention
from metalserve.executor.context import forward_context
from metalserve.executor.models.adapter import PagedModel
from metalserve.executor.models.compute import MlxCompute
from metalserve.executor.models.families import kv_cache_spec, kv_shape
from metalserve.loader import load_model
from metalserve.loader.weights_mode import parameter_bytes
from metalserve.platform import current_platform

BLOCK = 16


def decode_meta(batch: int, context: int) -> StepMeta:
    """`batch` requests with one query each at position context-1, each on its own blocks."""
    per = -(-context // BLOCK)
    rows = [np.arange(i * per, (i + 1) * per) for i in range(batch)]
    pos = np.full(batch, context - 1, np.int32)
    slots = np.array([r[-1] * BLOCK + (context - 1) % BLOCK for r in rows], np.int32)
    return StepMeta(
        pos,
        slots,
        np.arange(batch + 1, dtype=np.int32),
        np.full(batch, context, np.int32),
        rows,
        np.arange(batch, dtype=np.int32),
    )


def build_stage(args: argparse.Namespace, rank: int) -> tuple[Stage, PagedModel, range, int]:
    loaded = load_model(args.model)
    slices = split_layers(layer_bytes(loaded.model), 2, non_layer_bytes(loaded.model))
    keep_layers(loaded.model, slices[rank], first=rank == 0)
    model = PagedModel(loaded.model, loaded.model_type, MlxCompute())
    blocks = max(args.batches) * -(-args.context // BLOCK) + 1
    spec = kv_cache_spec(loaded, BLOCK, num_blocks=blocks)  # the slice's layers
    backend = select_attention("auto", kv_shape(loaded).dtype, current_platform())
    return Stage(model, spec, backend), model, slices[rank], parameter_bytes(loaded.model)


def rank0_step(stage: Stage, model: PagedModel, meta: StepMeta, group: mx.distributed.Group) -> list[float]:
    """[compute s, send s, round trip s, bytes out, bytes back, head compute s] for one decode step."""
    tokens = mx.array(np.arange(len(meta.positions)) % 1000 + 5)
    t0 = time.perf_counter()
    with forward_context(stage.context(meta)):
        hidden = run_layers(model, model.backbone.embed_tokens(tokens[None])[0])
    mx.eval(hidden, stage.pools())
    t1 = time.perf_counter()
    flat, width = meta.encode()
    payload = pack_payload(flat, hidden)
    assert payload is not None
    mx.eval(payload)
    n = len(meta.positions)
    send_message(Header(Kind.STEP, n, n, n, width, stage.spec.num_blocks, 0, payload.nbytes), payload, 1, group)
    t2 = time.perf_counter()
    reply = recv_header(1, group)
    back = recv_payload(reply, 1, group)
    t3 = time.perf_counter()
    assert back is not None
    rows = as_hidden(back, reply.num_rows, hidden.dtype)
    mx.eval(mx.argmax(model.mlx_logits(model.backbone.norm(rows)), axis=-1))
    t4 = time.perf_counter()
    return [t1 - t0, t2 - t1, t3 - t2, 4 * HEADER_LEN + payload.nbytes, 4 * HEADER_LEN + back.nbytes, t4 - t3]


def rank1_loop(stage: Stage, group: mx.distributed.Group, dtype: mx.Dtype) -> list[float]:
    """Serve steps until STOP; returns each step's compute seconds."""
    times = []
    while True:
        header = recv_header(0, group)
        if header.kind == Kind.STOP:
            return times
        flat, raw = split_payload(recv_payload(header, 0, group), header, with_meta=True)
        assert flat is not None
        meta = StepMeta.decode(flat, header)
        t0 = time.perf_counter()
        out = stage.forward(as_hidden(raw, header.num_tokens, dtype), meta)
        rows = out[mx.array(meta.logits_indices)]
        mx.eval(rows, stage.pools())
        times.append(time.perf_counter() - t0)
        result = pack_payload(None, rows)
        assert result is not None
        send_message(header._replace(kind=Kind.RESULT, payload_bytes=result.nbytes), result, 0, group)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    add_estimate_args(parser)
    args = parser.parse_args()
    child = None
    if "MLX_RANK" not in os.environ:
        os.environ.update(MLX_HOSTFILE=write_local_hostfile(2), MLX_RANK="0")
        child = subprocess.Popen([sys.executable, *sys.argv], env={**os.environ, "MLX_RANK": "1"})
    group = init_group(2)
    stage, model, layers, weights = build_stage(args, group.rank())
    if group.rank() == 1:
        times = rank1_loop(stage, group, getattr(mx, stage.spec.page.dtype))
        mx.eval(mx.distributed.send(mx.array(times, dtype=mx.float32), 0, group=group))
        return 0
    rows = measure(args, stage, model, group)
    peer = mx.distributed.recv((len(rows),), mx.float32, 1, group=group)
    mx.eval(peer)
    report(args, rows, peer.tolist(), layers, weights)
    if child is not None:
        child.wait(60)
    return 0


def measure(
    args: argparse.Namespace, stage: Stage, model: PagedModel, group: mx.distributed.Group
) -> list[list[float]]:
    rows = []
    for batch in args.batches:
        meta = decode_meta(batch, args.context)
        for i in range(args.steps + 2):  # two warm-up steps, not reported
            row = rank0_step(stage, model, meta, group)
            rows.append([batch, float(i >= 2), *row])
    send_message(Header(Kind.STOP, 0, 0, 0, 0, 0, -1, 0), None, 1, group)
    return rows


def add_estimate_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("the Thunderbolt 5 estimate (assumptions)")
    g.add_argument("--link-gbit", type=float, default=80.0, help="link rate, Gbit/s (Thunderbolt 5: 80)")
    g.add_argument("--link-efficiency", type=float, default=0.6, help="share of the link TCP reaches")
    g.add_argument("--link-latency-us", type=float, default=50.0, help="one message's fixed cost, microseconds")
    g.add_argument("--mac-gbs", type=float, default=546.0, help="memory bandwidth per Mac, GB/s (M4 Max: 546)")
    g.add_argument("--mac-tflops", type=float, default=15.0, help="effective fp16 TFLOP/s per Mac GPU")
    g.add_argument("--big-params-b", type=float, default=70.0, help="the model that needs both Macs, billions")
    g.add_argument("--big-weights-gb", type=float, default=40.0, help="its weights, GB (4-bit: ~40)")
    g.add_argument("--big-hidden", type=int, default=8192, help="its hidden size (a 70B llama: 8192)")
    g.add_argument("--big-act-bytes", type=int, default=2, help="bytes per activation (fp16/bf16 on Metal)")


def report(args: argparse.Namespace, rows: list[list[float]], peer: list[float], layers: range, weights: int) -> None:
    print(f"rank 0: layers {layers.start}-{layers.stop - 1}, {weights / 2**20:.0f} MiB; context {args.context}")
    print(
        "batch | bytes 0->1 | bytes 1->0 | rank0 ms (layers+head) | rank1 ms | transfer ms (both ways) | transfer share"
    )
    for batch in args.batches:
        mine = [(r, p) for r, p in zip(rows, peer, strict=True) if r[0] == batch and r[1]]
        c0 = statistics.median(r[2] + r[7] for r, _ in mine)
        c1 = statistics.median(p for _, p in mine)
        transfer = statistics.median(r[3] + r[4] - p for r, p in mine)  # send + round trip - rank 1's compute
        out, back = mine[0][0][5], mine[0][0][6]
        share = transfer / (c0 + c1 + transfer)
        cells = f"{batch:5d} | {out:10.0f} | {back:10.0f} | {1e3 * c0:22.2f} | {1e3 * c1:8.2f}"
        print(f"{cells} | {1e3 * transfer:23.2f} | {share:.1%}")
    estimate(args)


def stage_seconds(args: argparse.Namespace, tokens: int) -> float:
    """One rank's step on two Macs: it reads its half of the weights once (bandwidth) or computes its
    half of 2 FLOPs per parameter per token (compute), whichever takes longer."""
    read = args.big_weights_gb / 2 / args.mac_gbs
    flops = tokens * 2 * args.big_params_b * 1e9 / 2
    return max(read, flops / (args.mac_tflops * 1e12))


def estimate(args: argparse.Namespace) -> None:
    """Decode throughput on two Macs, one batch in flight against two (vLLM's virtual engines)."""
    rate = args.link_gbit / 8 * 1e9 * args.link_efficiency  # bytes/s
    print(
        f"\nThunderbolt 5 estimate: a {args.big_params_b:.0f}B model, {args.big_weights_gb:.0f} GB of weights split "
        f"in two; per Mac {args.mac_gbs:.0f} GB/s and {args.mac_tflops:.0f} effective TFLOP/s; link "
        f"{args.link_gbit:.0f} Gbit/s at {args.link_efficiency:.0%} + {args.link_latency_us:.0f} us per message"
    )
    print("batch | transfer ms/step | stage ms | one in flight tok/s | two in flight tok/s (two halves)")
    for batch in args.batches:
        moved = 2 * batch * args.big_hidden * args.big_act_bytes + 2 * 4 * (6 * batch + 64)
        transfer = moved / rate + 4 * args.link_latency_us * 1e-6  # header + payload, each way
        one = batch / (2 * stage_seconds(args, batch) + transfer)
        half = max(1, batch // 2)
        # Two halves in the pipe: each rank runs both halves per cycle and is never idle.
        cycle = max(2 * stage_seconds(args, half), stage_seconds(args, half) + transfer)
        two = 2 * half / cycle if batch > 1 else one
        print(
            f"{batch:5d} | {1e3 * transfer:16.3f} | {1e3 * stage_seconds(args, batch):8.1f} | {one:19.1f} | {two:.1f}"
        )


if __name__ == "__main__":
    sys.exit(main())
