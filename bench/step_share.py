"""How much of each step is spent outside the forward, with async scheduling on and off, on the
server's own path (AsyncEngine on its engine thread: schedule, forward, sample, detokenize, hand-over).

    .venv/bin/python bench/step_share.py [--batches 1 8] [--tokens 64] [--rounds 2]

The default model runs its whole decoder in numba on this CPU-only machine (the host path), so each
forward is one timed call; the rest of a step's wall time is Python and NumPy around it. With async
scheduling the next step is scheduled while the forward runs on its own thread, so less of that rest
stays on the critical path. The two engines are loaded once and run alternately, batch by batch.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any

# isort: off
import metalserve  # noqa: F401  (before MLX: it loads the optimized BLAS that MLX then binds)

# isort: on
import numpy as np

from metalserve.config import EngineConfig
from metalserve.engine.async_engine import AsyncEngine
from metalserve.sampling_params import SamplingParams
from metalserve.serving.engine_loader import start_engine
from metalserve.serving.model_spec import ModelSpec


class ForwardClock:
    """Times every host forward of one engine (the compute strategy's NumPy-only job)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.seconds: list[float] = []
        compute = engine.core.runner.model.compute  # type: ignore[attr-defined]
        if not hasattr(compute, "forward_on_host") or compute.forward_on_host is None:
            raise SystemExit("this bench times the host forward: run it where the model takes the CPU path")
        inner = compute.host_job

        def timed(*args: Any) -> Callable[[], np.ndarray] | None:
            job = inner(*args)
            if job is None:
                return None

            def run() -> np.ndarray:
                start = time.perf_counter()
                try:
                    return job()  # type: ignore[no-any-return]
                finally:
                    self.seconds.append(time.perf_counter() - start)

            return run

        compute.host_job = timed
        # How long the engine thread waits for a forward it launched (async scheduling only): the rest
        # of its time is host work, done while the forward runs.
        self.waits: list[float] = []
        runner = engine.core.runner  # type: ignore[attr-defined]
        make_pool = runner._forward_thread

        def timed_pool() -> Any:
            pool = make_pool()
            waits = self.waits

            class Timed:
                def submit(self, fn: Callable[[], np.ndarray]) -> Any:
                    future = pool.submit(fn)
                    result = future.result

                    def waited(timeout: float | None = None) -> np.ndarray:
                        start = time.perf_counter()
                        try:
                            return result(timeout)
                        finally:
                            waits.append(time.perf_counter() - start)

                    future.result = waited  # type: ignore[method-assign]
                    return future

            return Timed()

        runner._forward_thread = timed_pool


async def _generate(engine: AsyncEngine, batch: int, tokens: int, seed: int) -> int:
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)

    async def one(i: int) -> int:
        prompt = rng.integers(100, 20000, size=32).tolist()
        return sum([len(o.token_ids) async for o in engine.generate(prompt, params, f"s{seed}-{i}")])

    return sum(await asyncio.gather(*(one(i) for i in range(batch))))


def measure(engine: AsyncEngine, clock: ForwardClock, batch: int, tokens: int, seed: int) -> dict[str, float]:
    clock.seconds.clear()
    clock.waits.clear()
    start = time.perf_counter()
    produced = asyncio.run(_generate(engine, batch, tokens, seed))
    wall = time.perf_counter() - start
    steps = len(clock.seconds)
    forward = sum(clock.seconds)
    # In order, the engine thread runs the forward itself; ahead, it waits for it on the forward thread.
    blocked = sum(clock.waits) if clock.waits else forward
    return {
        "wall_ms_per_step": 1000 * wall / steps,
        "forward_ms_per_step": 1000 * forward / steps,
        "host_ms_per_step": 1000 * (wall - blocked) / steps,
        "outside_share": 1 - forward / wall,
        "tok_s": produced / wall,
        "steps": steps,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    engines = {}
    for mode in (True, False):
        config = EngineConfig(async_scheduling=mode, max_model_len=1024, kv_cache_memory=256 << 20)
        engine = start_engine(ModelSpec.of(config))
        engines[mode] = (engine, ForwardClock(engine))
        measure(engine, engines[mode][1], 2, 8, seed=0)  # warm-up: numba, the first steps
    rows: dict[tuple[bool, int], list[dict[str, float]]] = {}
    for r in range(a.rounds):
        for batch in a.batches:
            for mode in (True, False):
                engine, clock = engines[mode]
                rows.setdefault((mode, batch), []).append(measure(engine, clock, batch, a.tokens, seed=1 + r))
    print("host work: the engine thread's time not spent in (or waiting for) the forward; exposed: the part of")
    print("a step's wall time outside the forward, which async scheduling hides behind it.")
    print(
        "| async scheduling | batch | steps | wall ms/step | forward ms/step | host work ms/step | exposed |"
        " output tok/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for (mode, batch), runs in sorted(rows.items(), key=lambda kv: (kv[0][1], not kv[0][0])):
        med = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
        print(
            f"| {'on' if mode else 'off'} | {batch} | {med['steps']:.0f} | {med['wall_ms_per_step']:.1f} | "
            f"{med['forward_ms_per_step']:.1f} | {med['host_ms_per_step']:.1f} | "
            f"{100 * med['outside_share']:.0f} % | {med['tok_s']:.1f} |"
        )


if __name__ == "__main__":
    main()
