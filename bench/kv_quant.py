"""What --kv-cache-dtype costs and buys on the default model: perplexity with auto / int8 / q4 / k8v4 pages
over bench/data/sonnet.txt (prompt logprobs, the engine's own path), greedy agreement with auto (the share of
64-token greedy continuations of 32 prompts that are identical), tokens per GiB of KV cache, and decode
TPOT and prefill time at a 4k context. Every dtype runs in this one process, one after another.

Two control rows show what greedy agreement can be on this model: the same float32 model with its K/V
rounded to float16 and to bfloat16 as they are written (what 16-bit pages keep; MLX ops). A 135M model's
greedy continuations turn on near-ties, so even bfloat16 pages change some of them.

    .venv/bin/python bench/kv_quant.py            # the full table (a few minutes on 2 cores)
    .venv/bin/python bench/kv_quant.py --quick    # fewer windows, prompts and steps
    .venv/bin/python bench/kv_quant.py --speed-only   # only prefill and decode TPOT at a 4k context

bench/kv_quant_variants.py measures formats not built (K and V in different types, finer groups) against
the 16-bit controls on held-out texts and other models.

Attention: `--attention-backend auto` for every dtype (the numba kernel on the CPU path, which reads int8
and q4 pages too); `auto` pages are also measured on MLX ops, for a second backend's TPOT.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from metalserve.config import EngineConfig
from metalserve.engine.core import EngineCore
from metalserve.executor.attention.base import AttentionCall
from metalserve.executor.attention.mlx import MlxAttention, PortableKV
from metalserve.executor.attention.mlx_ops import AttentionPlan
from metalserve.kvcache.specs import KVCacheSpec
from metalserve.loader import LoadedModel, load_model
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams
from metalserve.serving.build import build_engine_core

TEXT = Path(__file__).resolve().parent / "data" / "sonnet.txt"
STORAGES = ("auto", "int8", "q4", "k8v4")
GIB = 1 << 30


@dataclass
class Row:
    name: str
    ppl: float = math.nan
    agreement: float = math.nan
    tokens_per_gib: float = math.nan
    prefill_s: float = math.nan
    tpot_ms: float = math.nan
    bytes_per_block: int = 0
    backend: str = ""


class RoundedPages(MlxAttention):
    """MLX ops with K/V rounded to a 16-bit float as they are written: the float32 model reading 16-bit pages."""

    def __init__(self, dtype: mx.Dtype) -> None:
        self.dtype = dtype

    def forward(self, call: AttentionCall[PortableKV, AttentionPlan]) -> mx.array:
        assert call.v is not None
        k, v = (x.astype(self.dtype).astype(x.dtype) for x in (call.k, call.v))
        return super().forward(call._replace(k=k, v=v))


def engine(storage: str, backend: str, max_model_len: int, model: str | None = None) -> tuple[EngineCore, LoadedModel]:
    loaded = load_model(model)  # a fresh copy: installing paged attention changes the model in place
    config = EngineConfig(
        kv_cache_memory=1 << 30,
        max_model_len=max_model_len,
        max_num_seqs=32,
        max_num_batched_tokens=512,
        kv_cache_dtype=storage,
        attention_backend=backend,
    )  # type: ignore[arg-type]
    return build_engine_core(config, loaded), loaded


def run(core: EngineCore, prompts: list[list[int]], params: SamplingParams) -> dict[str, list]:  # type: ignore[type-arg]
    """Every prompt to completion; per request the outputs' tokens and prompt logprobs."""
    for i, prompt in enumerate(prompts):
        core.add_request(Request(f"q{i}", list(prompt), params))
    got: dict[str, list] = {f"q{i}": [[], None] for i in range(len(prompts))}  # type: ignore[type-arg]
    while core.has_unfinished_requests():
        for out in core.step():
            got[out.request_id][0] += out.new_token_ids
            if out.prompt_logprobs is not None:
                got[out.request_id][1] = out.prompt_logprobs
    return got


def perplexity(core: EngineCore, ids: list[int], window: int, windows: int) -> float:
    chunks = [ids[i * window : (i + 1) * window] for i in range(windows)]
    got = run(core, chunks, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    logprobs = [e.logprob for tokens, entries in got.values() for e in entries[1:]]
    return math.exp(-sum(logprobs) / len(logprobs))


def continuations(core: EngineCore, prompts: list[list[int]], n: int) -> list[list[int]]:
    got = run(core, prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return [got[f"q{i}"][0] for i in range(len(prompts))]


SPEED_ARMS = (("auto", "auto"), ("int8", "auto"), ("q4", "auto"), ("k8v4", "auto"), ("auto", "mlx"))


def speed(ids: list[int], context: int, steps: int) -> dict[tuple[str, str], tuple[float, float]]:
    """Per (storage, backend): prefill seconds of a `context`-token prompt and the median decode step in ms
    after it. The engines decode in turns, one step each per round, so load on the machine falls on all
    arms alike."""
    prompt = (ids * (context // len(ids) + 1))[:context]
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    cores: dict[tuple[str, str], EngineCore] = {}
    prefill: dict[tuple[str, str], float] = {}
    for arm in SPEED_ARMS:
        core, _ = engine(arm[0], arm[1], context + steps + 64)
        core.add_request(Request("long", list(prompt), params))
        start = time.perf_counter()
        while not any(out.new_token_ids for out in core.step()):
            pass
        prefill[arm] = time.perf_counter() - start
        cores[arm] = core
        print(f"prefill {arm}: {prefill[arm]:.1f} s", flush=True)
    step_ms: dict[tuple[str, str], list[float]] = {arm: [] for arm in SPEED_ARMS}
    for _ in range(steps):
        for arm, core in cores.items():
            start = time.perf_counter()
            core.step()
            step_ms[arm].append((time.perf_counter() - start) * 1e3)
    return {arm: (prefill[arm], statistics.median(step_ms[arm])) for arm in SPEED_ARMS}


def tokens_per_gib(spec: KVCacheSpec) -> float:
    return GIB / spec.bytes_per_block * spec.block_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--window", type=int, default=512, help="tokens per perplexity window")
    parser.add_argument("--windows", type=int, default=0, help="perplexity windows (0: the whole text)")
    parser.add_argument("--context", type=int, default=4096, help="the long prompt's tokens; 0: skip that part")
    parser.add_argument("--speed-only", action="store_true", help="only prefill and decode TPOT at --context")
    args = parser.parse_args()
    if args.speed_only:
        ids = list(load_model(None).tokenizer.encode(TEXT.read_text()))
        print(f"\n| KV dtype | attention | prefill {args.context} s | decode TPOT ms (median) |\n|---|---|---|---|")
        for (storage, backend), (prefill_s, tpot_ms) in speed(ids, args.context, 8 if args.quick else 16).items():
            print(f"| {storage} | {backend} | {prefill_s:.1f} | {tpot_ms:.1f} |")
        return
    windows, prompts_n, new, steps = (2, 8, 32, 8) if args.quick else (args.windows or 1 << 30, 32, 64, 16)
    rows: dict[str, Row] = {}
    agreement_ref: list[list[int]] = []
    for storage in STORAGES:
        core, loaded = engine(storage, "auto", max(args.context, args.window) + 128)
        ids = list(loaded.tokenizer.encode(TEXT.read_text()))
        lines = [line for line in TEXT.read_text().splitlines() if len(line.split()) >= 5]
        prompts = [list(loaded.tokenizer.encode(" ".join(lines[i * 7 : i * 7 + 4]))) for i in range(prompts_n)]
        row = rows.setdefault(storage, Row(storage))
        row.ppl = perplexity(core, ids, args.window, min(windows, len(ids) // args.window))
        outs = continuations(core, prompts, new)
        if storage == "auto":
            agreement_ref = outs
        row.agreement = sum(a == b for a, b in zip(outs, agreement_ref, strict=True)) / len(outs)
        row.tokens_per_gib = tokens_per_gib(core.runner.spec)
        row.bytes_per_block = core.runner.spec.bytes_per_block
        row.backend = core.runner.backend.name
        tensors = core.runner.spec.tensors
        print(f"{storage}: attention {core.runner.backend.name}, {row}", flush=True)
        del core
        mx.clear_cache()
    controls = [Row(name) for name in ("float16", "bfloat16")]
    for row in controls:
        core, _ = engine("auto", "mlx", max(args.context, args.window) + 128)
        core.runner.backend = RoundedPages(getattr(mx, row.name))
        row.ppl = perplexity(core, ids, args.window, min(windows, len(ids) // args.window))
        outs = continuations(core, prompts, new)
        row.agreement = sum(a == b for a, b in zip(outs, agreement_ref, strict=True)) / len(outs)
        print(f"control {row.name} pages: {row}", flush=True)
        del core
    mlx_row = Row("auto on MLX ops")
    if args.context:
        timings = speed(ids, args.context, steps)
        for (storage, backend), (prefill_s, tpot_ms) in timings.items():
            row = mlx_row if backend == "mlx" else rows[storage]
            row.prefill_s, row.tpot_ms = prefill_s, tpot_ms
    heads, dim = tensors[0].shape
    fp16 = {
        s: KVCacheSpec.uniform(len(tensors), heads, dim, "float16", 2, 16, storage=s)  # type: ignore[arg-type]
        for s in STORAGES
    }
    base = rows["auto"]
    print(
        f"\ndefault model, {len(ids)}-token text ({TEXT.name}); ppl over {min(windows, len(ids) // args.window)} "
        f"windows of {args.window}; agreement of {prompts_n} x {new}-token greedy continuations; "
        f"decode TPOT: median of {steps} steps after a {args.context}-token prompt, the arms taking turns"
    )
    print(
        "| KV dtype | attention | perplexity | vs auto | greedy agreement | tokens/GiB here | vs fp16 pages "
        "| prefill 4k s | decode TPOT ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for storage in STORAGES:
        r = rows[storage]
        ratio16 = tokens_per_gib(fp16[storage]) / tokens_per_gib(fp16["auto"])
        backend = r.backend
        print(
            f"| {storage} | {backend} | {r.ppl:.3f} | {100 * (r.ppl / base.ppl - 1):+.2f}% | "
            f"{100 * r.agreement:.0f}% | {r.tokens_per_gib:,.0f} | {ratio16:.2f}x | {r.prefill_s:.1f} | "
            f"{r.tpot_ms:.1f} |"
        )
    print(f"| auto | MLX ops | | | | | | {mlx_row.prefill_s:.1f} | {mlx_row.tpot_ms:.1f} |")
    for r in controls:
        print(
            f"| control: {r.name} pages | MLX ops | {r.ppl:.3f} | {100 * (r.ppl / base.ppl - 1):+.2f}% | "
            f"{100 * r.agreement:.0f}% | | | | |"
        )
    print(
        f"\nbytes per 16-token block here ({tensors[0].page.dtype} model): "
        + ", ".join(f"{s} {rows[s].bytes_per_block:,}" for s in STORAGES)
    )


if __name__ == "__main__":
    main()
