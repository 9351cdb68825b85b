"""The paged-attention kernel against a float64 NumPy reference, on every backend.

Backends: the Metal source under the CPU emulator (here, in CI), real Metal (skipped without a Metal
device) and the portable MLX path. Same inputs for all; tolerances per dtype (cases.TOLERANCE).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np
import pytest

from metalserve.kernels import reference
from metalserve.kernels.emulator import emulate, emulate_race_checked
from metalserve.kernels.launch import KernelLaunch
from metalserve.kernels.metal import metal_paged_attention
from metalserve.kernels.paged import PagedArgs, run_paged_attention
from tests.kernels.cases import CASES, TOLERANCE, Case, Inputs, as_f64, make_inputs, reference_f64


def _emulator(case: Case, x: Inputs) -> mx.array:
    # Both thread orders must agree bit for bit: the kernel has no data race.
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
    return run_paged_attention(args, emulate_race_checked, case.partition_size)


def _metal(case: Case, x: Inputs) -> mx.array:
    if not mx.metal.is_available():
        pytest.skip("no Metal device here; the emulator rows run this kernel's source")
    return metal_paged_attention(
        x.q,
        x.k_pool,
        x.v_pool,
        x.block_tables,
        x.cu_seqlens_q,
        x.seq_lens,
        block_size=case.block_size,
        scale=x.scale,
        sliding_window=case.sliding_window,
        softcap=case.softcap,
        sinks=x.sinks,
        partition_size=case.partition_size,
    )


def _reference(case: Case, x: Inputs) -> mx.array:
    return reference.paged_attention(
        x.q,
        x.k_pool,
        x.v_pool,
        x.block_tables,
        x.cu_seqlens_q,
        x.seq_lens,
        block_size=case.block_size,
        scale=x.scale,
        sliding_window=case.sliding_window,
        softcap=case.softcap,
        sinks=x.sinks,
    )


def _reference_planned(case: Case, x: Inputs) -> mx.array:
    """The runner's form of the portable path: leading single-query requests attend as one batched group."""
    plan = reference.build_plan(
        np.array(x.block_tables), np.array(x.cu_seqlens_q), np.array(x.seq_lens), case.block_size,
        case.sliding_window, num_kv_heads=case.num_kv_heads,
    )  # fmt: skip
    opts = reference.AttentionOptions(x.scale, case.sliding_window, case.softcap, x.sinks)
    return reference.paged_attention_planned(x.q, reference.portable_pool(x.k_pool, x.v_pool), plan, opts)


BACKENDS: dict[str, Callable[[Case, Inputs], mx.array]] = {
    "emulator": _emulator,
    "metal": _metal,
    "reference": _reference,
    "reference_planned": _reference_planned,
}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_matches_float64_reference(backend: str, case: Case) -> None:
    x = make_inputs(case)
    out = BACKENDS[backend](case, x)
    assert out.shape == x.q.shape and out.dtype == x.q.dtype
    got = as_f64(out)
    want = reference_f64(case, x)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=TOLERANCE[case.dtype], rtol=0)


def test_cases_cover_the_issue() -> None:
    """Every head dim, dtype, block size, GQA ratio and option appears in at least one case."""
    assert {c.head_dim for c in CASES} == {64, 80, 96, 128, 256}
    assert {c.dtype for c in CASES} == {"float32", "float16", "bfloat16"}
    assert {c.block_size for c in CASES} == {8, 16, 32}
    assert {1, 3, 4, 8} <= {c.num_q_heads // c.num_kv_heads for c in CASES}
    assert any(c.sliding_window for c in CASES) and any(c.softcap for c in CASES)
    assert any(c.sinks for c in CASES) and any(c.partition_size for c in CASES)
    assert any(any(kv % c.block_size for _, kv in c.reqs) for c in CASES)


def test_split_case_straddles_partition_edges() -> None:
    split = next(c for c in CASES if c.name == "split_boundaries")
    size = split.partition_size or 0
    lengths = {kv for _, kv in split.reqs}
    assert {size - 1, size, size + 1, 2 * size, 2 * size + 1} <= lengths


def test_entry_point_matches_reference_here() -> None:
    """Without Metal the entry point is the portable path, bit for bit."""
    from metalserve.kernels.metal import paged_attention

    case = CASES[0]
    x = make_inputs(case)
    got = paged_attention(
        x.q, x.k_pool, x.v_pool, x.block_tables, x.cu_seqlens_q, x.seq_lens, block_size=case.block_size, scale=x.scale
    )
    want = _reference(case, x)
    if not mx.metal.is_available():
        assert mx.array_equal(got, want)
    else:
        np.testing.assert_allclose(as_f64(got), as_f64(want), atol=TOLERANCE[case.dtype])


ASAN_CASE = next(c for c in CASES if c.name == "mixed")


def asan_case_launches() -> list[KernelLaunch]:
    """The launches of the ASan test, for conftest.py's parallel warm-up."""
    from tests.kernels.conftest import launches_of

    return launches_of((ASAN_CASE,))


def test_kernel_reads_in_bounds_under_asan() -> None:
    """The AddressSanitizer build of the kernel, every buffer in its own exact-size allocation."""
    case = ASAN_CASE
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
    out = run_paged_attention(args, lambda launch: emulate(launch, asan=True), case.partition_size)
    np.testing.assert_allclose(as_f64(out), reference_f64(case, x), atol=TOLERANCE[case.dtype], rtol=0)
