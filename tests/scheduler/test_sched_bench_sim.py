"""The scheduling simulation: continuous batching beats static batching at the same batch cap."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_sim() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "bench" / "scheduler_sim.py"
    spec = importlib.util.spec_from_file_location("scheduler_sim", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["scheduler_sim"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_continuous_batching_at_least_1_8x_static_and_lower_latency() -> None:
    sim = load_sim()
    jobs = sim.make_jobs(n=300, rate=50.0, median_out=64, sigma=1.2, seed=1)
    static = sim.run_static(jobs, batch=16, a=0.01, b=0.0002)
    cont = sim.run_continuous(jobs, batch=16, a=0.01, b=0.0002, budget=1024)
    assert cont.output_tokens == static.output_tokens == sum(j.output_len for j in jobs)
    assert len(cont.latencies) == len(static.latencies) == len(jobs)
    assert sim.speedup(static, cont) >= 1.8
    assert sorted(cont.latencies)[len(jobs) // 2] < sorted(static.latencies)[len(jobs) // 2]
