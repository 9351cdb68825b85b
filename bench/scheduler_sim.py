"""Continuous batching (this scheduler) against static batching, on a cost model of one step.

A step costs `a + b * tokens` seconds. Requests arrive as a Poisson process with uniform prompt
lengths and long-tailed (log-normal) output lengths. Static batching takes up to `batch` waiting
requests, pads their prompts to the longest, and decodes the padded batch until its longest output
is done. Continuous batching runs the real Scheduler with `max_num_seqs = batch`. Prints throughput
and p50/p95 latency for both. Usage: python bench/scheduler_sim.py [--requests N] [--rate R] ...
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

from metalserve.config import EngineConfig
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams
from metalserve.scheduler.output import ModelRunnerOutput
from metalserve.scheduler.scheduler import Scheduler

MAX_MODEL_LEN = 4096


@dataclass(frozen=True)
class Job:
    """One simulated request: when it arrives, its prompt and output lengths."""

    arrival: float
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class Result:
    name: str
    makespan: float
    output_tokens: int
    latencies: list[float]

    def row(self) -> str:
        lat = sorted(self.latencies)
        p50, p95 = lat[len(lat) // 2], lat[int(0.95 * (len(lat) - 1))]
        tput = self.output_tokens / self.makespan
        return f"{self.name:<12} {tput:>12.1f} {p50:>10.2f} {p95:>10.2f} {self.makespan:>10.1f}"


def make_jobs(n: int, rate: float, median_out: int, sigma: float, seed: int) -> list[Job]:
    rng = random.Random(seed)
    t, jobs = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out = min(1024, max(1, round(rng.lognormvariate(0.0, sigma) * median_out)))
        jobs.append(Job(t, rng.randint(32, 512), out))
    return jobs


def run_static(jobs: list[Job], batch: int, a: float, b: float) -> Result:
    clock, i, latencies = 0.0, 0, []
    while i < len(jobs):
        clock = max(clock, jobs[i].arrival)
        group = [j for j in jobs[i : i + batch] if j.arrival <= clock]
        i += len(group)
        clock += a + b * len(group) * max(j.prompt_len for j in group)  # padded prefill
        longest = max(j.output_len for j in group)
        # Every decode step runs the whole padded batch; a request's reply is ready when it is done.
        for j in group:
            latencies.append(clock + (j.output_len - 1) * (a + b * len(group)) - j.arrival)
        clock += (longest - 1) * (a + b * len(group))
    total = sum(j.output_len for j in jobs)
    return Result("static", clock - jobs[0].arrival, total, latencies)


def run_continuous(jobs: list[Job], batch: int, a: float, b: float, budget: int) -> Result:
    cfg = EngineConfig(max_num_seqs=batch, max_num_batched_tokens=budget, block_size=16)
    sched = Scheduler(cfg, batch * MAX_MODEL_LEN // 16 + 1, MAX_MODEL_LEN)
    clock, i, latencies, total = 0.0, 0, [], 0
    while i < len(jobs) or sched.has_unfinished_requests():
        if not sched.has_unfinished_requests():
            clock = max(clock, jobs[i].arrival)
        while i < len(jobs) and jobs[i].arrival <= clock:
            params = SamplingParams(max_tokens=jobs[i].output_len, ignore_eos=True)
            sched.add_request(Request(str(i), [5] * jobs[i].prompt_len, params, arrival_time=jobs[i].arrival))
            i += 1
        out = sched.schedule()
        clock += a + b * out.total_num_scheduled_tokens
        sampled = {
            rid: [7]
            for rid in out.num_scheduled_tokens
            if sched.requests[rid].num_computed_tokens == sched.requests[rid].num_tokens
        }
        for o in sched.update_from_output(out, ModelRunnerOutput(sampled)):
            total += len(o.new_token_ids)
            if o.finished:
                latencies.append(clock - jobs[int(o.request_id)].arrival)
    return Result("continuous", clock - jobs[0].arrival, total, latencies)


def speedup(static: Result, cont: Result) -> float:
    return (cont.output_tokens / cont.makespan) / (static.output_tokens / static.makespan)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--rate", type=float, default=8.0, help="arrivals per second (Poisson)")
    ap.add_argument("--batch", type=int, default=32, help="static batch size = max_num_seqs")
    ap.add_argument("--a", type=float, default=0.010, help="fixed cost of a step, seconds")
    ap.add_argument("--b", type=float, default=0.0002, help="cost per token in a step, seconds")
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--median-out", type=int, default=64)
    ap.add_argument("--sigma", type=float, default=1.2, help="log-normal sigma of output lengths")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    jobs = make_jobs(args.requests, args.rate, args.median_out, args.sigma, args.seed)
    static = run_static(jobs, args.batch, args.a, args.b)
    cont = run_continuous(jobs, args.batch, args.a, args.b, args.budget)
    assert static.output_tokens == cont.output_tokens
    print(
        f"{args.requests} requests, Poisson {args.rate}/s, batch cap {args.batch}, "
        f"step = {args.a} + {args.b} x tokens s, outputs log-normal(median {args.median_out}, "
        f"sigma {args.sigma})"
    )
    print(f"{'policy':<12} {'output tok/s':>12} {'p50 lat s':>10} {'p95 lat s':>10} {'makespan s':>10}")
    print(static.row())
    print(cont.row())
    print(f"continuous / static throughput: {speedup(static, cont):.2f}x")


if __name__ == "__main__":
    main()
