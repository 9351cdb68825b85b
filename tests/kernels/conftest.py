"""Warms the emulator's kernel cache for the whole module in parallel before the first test runs."""

from __future__ import annotations

import mlx.core as mx
import pytest

from metalserve.kernels.emulator.build import build_all
from metalserve.kernels.emulator.signature import generate
from metalserve.kernels.launch import KernelLaunch
from metalserve.kernels.paged import PagedArgs, run_paged_attention
from tests.kernels.cases import CASES, make_inputs


def launches_of(case_list: tuple = CASES) -> list[KernelLaunch]:
    """Every launch the cases make, found by running them with an executor that only records."""
    seen: list[KernelLaunch] = []

    def record(launch: KernelLaunch) -> list[mx.array]:
        seen.append(launch)
        return [mx.zeros(s, d) for s, d in zip(launch.output_shapes, launch.output_dtypes, strict=True)]

    for case in case_list:
        x = make_inputs(case)
        args = PagedArgs(x.q, x.k_pool, x.v_pool, x.block_tables, x.cu_seqlens_q, x.seq_lens,
                         case.block_size, x.scale, case.sliding_window, case.softcap, x.sinks)
        run_paged_attention(args, record, case.partition_size)
    return seen


@pytest.fixture(scope="session", autouse=True)
def warm_emulator_cache() -> None:
    kernels = {k.name: k for k in (generate(launch) for launch in launches_of())}
    build_all(list(kernels.values()))
