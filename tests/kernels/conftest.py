"""Warms the emulator's kernel cache for the whole module in parallel before the first test runs."""

from __future__ import annotations

import mlx.core as mx
import pytest

from metalserve.kernels.metal.launch import KernelLaunch
from metalserve.kernels.metal.paged import PagedArgs, run_paged_attention
from tests.kernels.cases import CASES, Case, make_inputs
from tools.msl_emulator.build import build_all
from tools.msl_emulator.signature import generate


def launches_of(
    case_list: tuple[Case, ...] = CASES, kernels: tuple[str, ...] = ("tiled", "decode")
) -> list[KernelLaunch]:
    """Every launch the cases make with each kernel, found with an executor that only records."""
    seen: list[KernelLaunch] = []

    def record(launch: KernelLaunch) -> list[mx.array]:
        seen.append(launch)
        return [mx.zeros(s, d) for s, d in zip(launch.output_shapes, launch.output_dtypes, strict=True)]

    for case in case_list:
        x = make_inputs(case)
        args = PagedArgs(
            x.q,
            x.k_pool,
            x.v_pool,
            x.block_tables,
            x.cu_seqlens_q,
            x.seq_lens,
            case.block_size,
            x.scale,
            case.sliding_window,
            case.softcap,
            x.sinks,
        )
        for kernel in (k for k in kernels if k in case.kernels):
            run_paged_attention(args, record, None if kernel == "tiled" else case.partition_size, kernel)
    return seen


@pytest.fixture(scope="session", autouse=True)
def warm_emulator_cache() -> None:
    """Compile every kernel the module needs up front, in parallel (cold CI: minutes -> about one)."""
    from tests.kernels.test_emulator import ASAN_LAUNCHES, LAUNCHES
    from tests.kernels.test_emulator_simdgroup import LAUNCHES as SIMDGROUP_LAUNCHES
    from tests.kernels.test_paged_attention import asan_case_launches
    from tests.kernels.test_tile_fallback import warm_launches

    pairs = [(launch, False) for launch in [*launches_of(), *LAUNCHES, *SIMDGROUP_LAUNCHES, *warm_launches()]]
    pairs += [(launch, True) for launch in [*ASAN_LAUNCHES, *asan_case_launches()]]
    unique = {(k.source, asan): (k, asan) for k, asan in ((generate(x), a) for x, a in pairs)}
    build_all(list(unique.values()))
