"""CPU time of one schedule() + update_from_output() step: 256 running requests of 2,000 tokens each.

Prefix caching is on and all prompts share a 1,024-token system prefix. Prints per-step CPU time
(median, p95, mean) over the measured decode steps. Usage: python bench/scheduler_step.py [--steps N]
"""

from __future__ import annotations

import argparse
import statistics
import time

from metalserve.config import EngineConfig
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams
from metalserve.scheduler.output import ModelRunnerOutput
from metalserve.scheduler.scheduler import Scheduler


def build(num_reqs: int, prompt_len: int, block_size: int) -> Scheduler:
    cfg = EngineConfig(
        block_size=block_size, max_num_seqs=num_reqs, max_num_batched_tokens=8192, enable_prefix_caching=True
    )
    max_model_len = 4096
    num_blocks = num_reqs * (max_model_len // block_size) // 2 + 1
    sched = Scheduler(cfg, num_blocks, max_model_len)
    shared = list(range(1024))
    params = SamplingParams(max_tokens=max_model_len, ignore_eos=True)
    for i in range(num_reqs):
        tail = [10_000 + i * prompt_len + j for j in range(prompt_len - len(shared))]
        sched.add_request(Request(f"req-{i}", shared + tail, params, arrival_time=float(i)))
    # Prefill everything, untimed, until every request is decoding.
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.requests.values()):
        step(sched)
    return sched


def step(sched: Scheduler) -> None:
    out = sched.schedule()
    sampled = {
        rid: [7]
        for rid in out.num_scheduled_tokens
        if sched.requests[rid].num_computed_tokens == sched.requests[rid].num_tokens
    }
    sched.update_from_output(out, ModelRunnerOutput(sampled))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=2000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    sched = build(args.requests, args.prompt_len, args.block_size)
    # The runner's sampling dict is built outside the timed region: it is the runner's cost.
    times, sched_times = [], []
    for _ in range(args.steps):
        t0 = time.process_time()
        out = sched.schedule()
        t1 = time.process_time()
        sampled = {rid: [7] for rid in out.num_scheduled_tokens}
        t2 = time.process_time()
        outputs = sched.update_from_output(out, ModelRunnerOutput(sampled))
        t3 = time.process_time()
        assert len(outputs) == args.requests
        times.append((t1 - t0) + (t3 - t2))
        sched_times.append(t1 - t0)
    ms = sorted(t * 1e3 for t in times)
    stats = sched.make_stats()
    print(
        f"{args.requests} running requests, ~{args.prompt_len + args.steps // 2} tokens each, "
        f"block_size {args.block_size}, prefix caching on ({stats.prefix_cache_hits} hit tokens)"
    )
    print(
        f"schedule+update CPU time per step: median {statistics.median(ms):.3f} ms, "
        f"p95 {ms[int(0.95 * len(ms))]:.3f} ms, mean {statistics.mean(ms):.3f} ms over {len(ms)} steps "
        f"(schedule alone: median {statistics.median(sched_times) * 1e3:.3f} ms)"
    )


if __name__ == "__main__":
    main()
