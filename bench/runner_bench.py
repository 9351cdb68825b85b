"""Prefill and decode speed of metalserve's packed paged step vs mlx-lm's own forward, same weights.

    .venv/bin/python bench/runner_bench.py [--model PATH] [--batches 1 8 32] [--context 256]

Prints one table with both and their ratio (metalserve / mlx-lm throughput; > 1 means metalserve is faster).
Decode steps of the two run in alternating blocks, so machine noise falls on both alike.
metalserve runs with its CPU attention path (the numba kernel for every row; the server's default on a
machine without Metal) and, with `--attention mlx` too, with the MLX-ops backend.
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
from mlx_lm.models.cache import make_prompt_cache

from metalserve.executor.attention.cpu import CpuAttention
from metalserve.executor.attention.mlx import MlxAttention
from metalserve.executor.host import paged_model
from metalserve.executor.models.adapter import PagedModel
from metalserve.executor.runner import ModelRunner
from metalserve.executor.sampler import Sampler
from metalserve.loader import LoadedModel, load_model
from metalserve.platform import current_platform
from metalserve.sampling_params import SamplingParams
from metalserve.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput


def median_time(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def mlx_lm_prefill(loaded: LoadedModel, n: int, repeats: int) -> float:
    prompt = mx.array(np.random.default_rng(0).integers(0, 1000, size=(1, n)))

    def run() -> None:
        cache = make_prompt_cache(loaded.model)
        mx.eval(mx.argmax(loaded.model(prompt, cache=cache)[:, -1], axis=-1))

    run()
    return n / median_time(run, repeats)


def mlx_lm_decode_step(loaded: LoadedModel, batch: int, context: int) -> Callable[[], None]:
    cache = make_prompt_cache(loaded.model)
    prompt = mx.array(np.random.default_rng(1).integers(0, 1000, size=(batch, context)))
    tok = mx.argmax(loaded.model(prompt, cache=cache)[:, -1:], axis=-1)
    mx.eval(tok)

    def step() -> None:
        nonlocal tok
        tok = mx.argmax(loaded.model(tok, cache=cache)[:, -1:], axis=-1)
        mx.eval(tok)

    step()
    return step


def paged_runner(
    loaded: LoadedModel, model: PagedModel, num_tokens: int, cpu: bool, block_size: int = 16
) -> ModelRunner:
    blocks = -(-num_tokens // block_size) + 64
    spec = model.get_kv_cache_spec(model.family.page(loaded.model), block_size, blocks)
    backend = CpuAttention() if cpu else MlxAttention()
    return ModelRunner(model, spec, eos_token_ids=frozenset(), sampler=Sampler(0), backend=backend)


def ours_prefill(loaded: LoadedModel, model: PagedModel, n: int, repeats: int, cpu: bool) -> float:
    prompt = np.random.default_rng(0).integers(0, 1000, size=n).tolist()
    runner = paged_runner(loaded, model, n, cpu)
    params = SamplingParams(temperature=0, max_tokens=1)
    counter = iter(range(1 << 30))

    def run() -> None:
        rid = f"p{next(counter)}"
        new = NewRequestData(rid, prompt, n, params, (list(range(-(-n // 16))),), 0)
        runner.execute_model(SchedulerOutput([new], [], {rid: n}, n))
        runner.execute_model(SchedulerOutput([], [], {}, 0, finished_req_ids={rid}))

    run()
    return n / median_time(run, repeats)


def ours_decode_step(
    loaded: LoadedModel, model: PagedModel, batch: int, context: int, steps: int, cpu: bool
) -> Callable[[], None]:
    bs = 16
    per_req = -(-(context + 2 * steps + 8) // bs)  # room for the timed steps and the untimed ones
    runner = paged_runner(loaded, model, batch * per_req * bs, cpu)
    rng = np.random.default_rng(1)
    params = SamplingParams(temperature=0, max_tokens=1 << 20, ignore_eos=True)
    news = [
        NewRequestData(
            f"r{i}",
            rng.integers(0, 1000, size=context).tolist(),
            context,
            params,
            (list(range(i * per_req, (i + 1) * per_req)),),
            0,
        )
        for i in range(batch)
    ]
    runner.execute_model(SchedulerOutput(news, [], {n.request_id: context for n in news}, batch * context))
    computed = {n.request_id: context for n in news}

    def step() -> None:
        cached = [CachedRequestData(rid, ([],), computed[rid]) for rid in computed]
        runner.execute_model(SchedulerOutput([], cached, dict.fromkeys(computed, 1), batch))
        for rid in computed:
            computed[rid] += 1

    step()
    return step


def interleaved_medians(
    a: Callable[[], None], b: Callable[[], None], repeats: int, block: int = 4
) -> tuple[float, float]:
    """Median step times of `a` and `b`, run in alternating blocks of `block` consecutive steps.

    Alternating cancels the shared machine's drift; consecutive steps within a block keep what each one
    leaves behind (busy-waiting BLAS threads, caches) on its own next step, as when serving. The first
    step of each block is run untimed, so neither pays for the other's leftovers.
    """
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(max(1, -(-repeats // block))):
        for fn, out in ((a, times[0]), (b, times[1])):
            fn()
            for _ in range(block):
                t = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t)
    return statistics.median(times[0]), statistics.median(times[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--attention", nargs="+", choices=["cpu", "mlx"], default=["cpu"])
    args = ap.parse_args()
    # mlx-lm on the fp32 weights (MKL), as mlx_lm.server would run it; ours as the server loads it (on the
    # CPU path: a GGUF of a fast-path family in its codes alone).
    reference = load_model(args.model, weights="dequantize")
    ours = load_model(args.model)  # a second copy: PagedModel takes over its attention layers
    paged = paged_model(ours, current_platform())
    print(reference.describe(), flush=True)
    print(ours.describe(), flush=True)
    rows = []
    for path in args.attention:  # each measured right after mlx-lm, so both see the same machine load
        cpu, tag = path == "cpu", f" [{path}]"
        a = mlx_lm_prefill(reference, args.prefill_tokens, 3)
        b = ours_prefill(ours, paged, args.prefill_tokens, 3, cpu)
        rows.append((f"prefill {args.prefill_tokens} tok (tok/s){tag}", a, b, b / a))
        for batch in args.batches:
            step_a = mlx_lm_decode_step(reference, batch, args.context)
            step_b = ours_decode_step(ours, paged, batch, args.context, args.steps, cpu)
            ta, tb = interleaved_medians(step_a, step_b, args.steps)
            rows.append((f"decode batch {batch} @ {args.context} ctx (ms/step){tag}", ta * 1e3, tb * 1e3, ta / tb))
            rows.append((f"decode batch {batch} (tok/s){tag}", batch / ta, batch / tb, ta / tb))
    print("\n| measure | mlx-lm | metalserve | ratio (metalserve speed / mlx-lm) |\n|---|---|---|---|")
    for name, x, y, r in rows:
        print(f"| {name} | {x:.1f} | {y:.1f} | {r:.2f}x |")


if __name__ == "__main__":
    main()
