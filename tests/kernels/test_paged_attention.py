"""The paged-attention kernel against a float64 NumPy reference, on every backend.

Backends: the Metal source under the CPU emulator (here, in CI), real Metal (skipped without a Metal
device) and the portable MLX path. Same inputs for all; tolerances per dtype (cases.TOLERANCE).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np
import pytest

from metalserve.executor.attention import mlx_ops
from metalserve.executor.attention.base import AttentionOptions
from metalserve.kernels.metal.gpu import metal_paged_attention
from metalserve.kernels.metal.launch import KernelLaunch
from metalserve.kernels.metal.paged import PagedArgs, run_paged_attention
from metalserve.kernels.metal.tiled import tiling
from tests.kernels.cases import CASES, TOLERANCE, Case, Inputs, as_f64, make_inputs, reference_f64
from tools.msl_emulator import emulate, emulate_race_checked


def paged_args(case: Case, x: Inputs) -> PagedArgs:
    return PagedArgs(
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


def kernel_options(case: Case, kernel: str) -> tuple[int | None, str]:
    """(partition_size, kernel) for one kernel: the tiled one has no split-KV to force."""
    return (None if kernel == "tiled" else case.partition_size), kernel


def _emulator(kernel: str) -> Callable[[Case, Inputs], mx.array]:
    def run(case: Case, x: Inputs) -> mx.array:
        # Both thread orders must agree bit for bit: the kernel has no data race.
        return run_paged_attention(paged_args(case, x), emulate_race_checked, *kernel_options(case, kernel))

    return run


def _metal(kernel: str) -> Callable[[Case, Inputs], mx.array]:
    def run(case: Case, x: Inputs) -> mx.array:
        if not mx.metal.is_available():
            pytest.skip("no Metal device here; the emulator rows run this kernel's source")
        partition_size, name = kernel_options(case, kernel)
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
            partition_size=partition_size,
            kernel=name,
        )

    return run


def _reference(case: Case, x: Inputs) -> mx.array:
    return mlx_ops.paged_attention(
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
    plan = mlx_ops.build_plan(
        np.array(x.block_tables),
        np.array(x.cu_seqlens_q),
        np.array(x.seq_lens),
        case.block_size,
        case.sliding_window,
        num_kv_heads=case.num_kv_heads,
    )
    opts = AttentionOptions(x.scale, case.sliding_window, case.softcap, x.sinks)
    return mlx_ops.paged_attention_planned(x.q, mlx_ops.portable_pool(x.k_pool, x.v_pool), plan, opts)


BACKENDS: dict[str, Callable[[Case, Inputs], mx.array]] = {
    "emulator_tiled": _emulator("tiled"),
    "emulator_decode": _emulator("decode"),
    "metal_tiled": _metal("tiled"),
    "metal_decode": _metal("decode"),
    "reference": _reference,
    "reference_planned": _reference_planned,
}


# Which kernel a backend runs; the tile-edge cases are for the tiled kernel only.
BACKEND_KERNEL = {
    "emulator_tiled": "tiled",
    "emulator_decode": "decode",
    "metal_tiled": "tiled",
    "metal_decode": "decode",
}
PAIRS = [(b, c) for b in BACKENDS for c in CASES if BACKEND_KERNEL.get(b, c.kernels[0]) in c.kernels]


@pytest.mark.parametrize(("backend", "case"), PAIRS, ids=[f"{b}-{c.name}" for b, c in PAIRS])
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


def test_cases_cover_the_tiles() -> None:
    """Tiles that end inside a request, requests that start inside a tile, partial key tiles, and GQA
    1, 4 and 8 packed into tiles of several tokens."""
    multi_tile_gqa = set()
    for c in CASES:
        t = tiling(c.num_q_heads // c.num_kv_heads, c.head_dim)
        assert t is not None
        if any(q > t.tile_q and q % t.tile_q for q, _ in c.reqs):
            multi_tile_gqa.add(c.num_q_heads // c.num_kv_heads)
    assert {1, 4, 8} <= multi_tile_gqa
    starts = [np.cumsum([0] + [q for q, _ in c.reqs])[:-1] for c in CASES]
    assert any(any(s % 16 for s in st[1:]) for st in starts)
    assert any(
        any(
            kv % tiling(c.num_q_heads // c.num_kv_heads, c.head_dim).key_tile  # type: ignore[union-attr]
            for _, kv in c.reqs
        )
        for c in CASES
    )
    assert any(c.sliding_window and max(q for q, _ in c.reqs) > c.sliding_window for c in CASES)


def test_split_case_straddles_partition_edges() -> None:
    split = next(c for c in CASES if c.name == "split_boundaries")
    size = split.partition_size or 0
    lengths = {kv for _, kv in split.reqs}
    assert {size - 1, size, size + 1, 2 * size, 2 * size + 1} <= lengths


# Decode kernel: decodes, a prefill and a chunk over partial blocks. Tiled kernel: partial blocks and
# partial key tiles (the cheapest tiled case to run under ASan).
ASAN_CASES = {
    "decode": next(c for c in CASES if c.name == "mixed"),
    "tiled": next(c for c in CASES if c.name == "prefill"),
}


def asan_case_launches() -> list[KernelLaunch]:
    """The launches of the ASan test, for conftest.py's parallel warm-up."""
    from tests.kernels.conftest import launches_of

    return [
        *launches_of((ASAN_CASES["decode"],), kernels=("decode",)),
        *launches_of((ASAN_CASES["tiled"],), kernels=("tiled",)),
    ]


@pytest.mark.parametrize("kernel", ["tiled", "decode"])
def test_kernel_reads_in_bounds_under_asan(kernel: str) -> None:
    """The AddressSanitizer build of each kernel, every buffer in its own exact-size allocation."""
    case = ASAN_CASES[kernel]
    x = make_inputs(case)
    out = run_paged_attention(
        paged_args(case, x), lambda launch: emulate(launch, asan=True), *kernel_options(case, kernel)
    )
    np.testing.assert_allclose(as_f64(out), reference_f64(case, x), atol=TOLERANCE[case.dtype], rtol=0)


def test_auto_choice_from_shapes() -> None:
    """A batch with a prefill takes the tiled kernel, an all-decode batch the decode kernel (split-KV)."""
    from metalserve.kernels.metal.paged import choose_kernel

    for case in CASES:
        args = paged_args(case, make_inputs(case))
        want = "tiled" if sum(q for q, _ in case.reqs) > len(case.reqs) and not case.partition_size else "decode"
        assert choose_kernel(args, "auto", case.partition_size) == want
    with pytest.raises(ValueError, match="partition_size"):
        choose_kernel(paged_args(CASES[0], make_inputs(CASES[0])), "tiled", 32)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_every_tiling_fits_threadgroup_memory(head_dim: int) -> None:
    from metalserve.kernels.metal.tiled import THREADGROUP_MEMORY, max_rows, threadgroup_bytes

    for group in range(1, 129):
        t = tiling(group, head_dim)
        if t is None:
            assert group > max_rows(head_dim)  # one token's heads alone exceed a tile
            continue
        assert t.rows % 8 == 0 and t.tile_q * group <= t.rows <= max_rows(head_dim)
        assert threadgroup_bytes(head_dim, t.rows, t.key_tile) <= THREADGROUP_MEMORY
        assert t.key_tile in (8, 16, 32) and head_dim % 4 == 0
