"""`CpuAttention.warm_up` loads the very kernel specialisation a real step calls: pipeline and
tensor-parallel ranks run it at set-up, so the first request does not pay numba's load on each rank in
turn (22-41 s for 4 ranks on a loaded 2-core machine, against 3 s with the MLX attention backend)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import mlx.core as mx
import numpy as np
from metalserve.executor.attention.base import AttentionOptions
from metalserve.executor.attention.cpu import CpuAttention
from metalserve.kernels.cpu.attention import attend
from metalserve.kernels.cpu.paged import build_cpu_plan, cpu_paged_attention, host_view

CpuAttention().warm_up()
warmed = len(attend.signatures)
pool = host_view(mx.zeros((2, 2, 32, 16), mx.float32))
plan = build_cpu_plan(np.array([[0, 1]]), np.array([0, 3]), np.array([3]), np.array([0, 1, 2]), 16)
q, k = mx.ones((3, 4, 16)), mx.ones((3, 2, 16))
cpu_paged_attention(q, k, k, pool, plan, AttentionOptions(scale=0.25))
print(warmed, len(attend.signatures))
"""


def test_warm_up_loads_the_kernel_a_step_uses() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True).stdout.split()
    # One specialisation of the entry kernel (`attend`, which calls the row kernel inside) after the
    # warm-up, and the real call added none.
    assert out == ["1", "1"]
