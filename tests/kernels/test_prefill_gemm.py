"""The CPU path's prefill kernels: packed-codes tiles through MKL's GEMM, and blocked causal attention, against
a float64 matmul and the row-by-row paged kernel."""

from __future__ import annotations

import os

import numpy as np
import pytest

from metalserve.kernels.cpu import gemm as cpu_gemm
from metalserve.kernels.cpu.attention import RUN_MIN_ROWS, _attention_kernel, attend
from metalserve.kernels.cpu.attention_prefill import chunk_attention
from metalserve.kernels.cpu.gemm import host_gemm, to_bf16
from metalserve.kernels.cpu.packed_gemm import GEMM_MIN_ROWS, segments_gemm_kernel
from metalserve.kernels.cpu.packed_linear import packed_linear, segments_of
from metalserve.platform import current_platform
from tests.kernels.test_packed_codes import random_codes

pytestmark = pytest.mark.skipif(not current_platform().numba, reason="the CPU kernels need numba")


def test_mkl_is_found_where_the_mkl_package_is_installed() -> None:
    from metalserve.blas import find_mkl

    assert host_gemm().usable == (find_mkl() is not None)


@pytest.mark.parametrize("tokens", [GEMM_MIN_ROWS, 130])
def test_the_gemm_kernel_matches_a_dense_matmul_over_mixed_blocks_and_layers(tokens: int) -> None:
    """A Q4_K_M-like fused q/k/v (4-bit q and k, 6-bit v in groups of 16) in two layers packed differently,
    with more rows than one tile and blocks that are not multiples of a tile: each tile's columns land at
    their own offset of the output."""
    gemm = host_gemm()
    if not gemm.usable:
        pytest.skip("no MKL: projections keep the register-tile kernel")
    layer0 = [random_codes(300, 96, 4, 32, 1), random_codes(6, 96, 4, 32, 2), random_codes(20, 96, 6, 16, 3)]
    layer1 = [random_codes(300, 96, 8, 32, 4), random_codes(6, 96, 5, 32, 5), random_codes(20, 96, 4, 32, 6)]
    rng = np.random.default_rng(tokens)
    bias = rng.standard_normal((2, 326)).astype(np.float32)
    segments = segments_of([[p for p, _ in layer0], [p for p, _ in layer1]], bias)
    x = rng.standard_normal((tokens, 96)).astype(np.float32)
    for layer, parts in enumerate((layer0, layer1)):
        dense = np.concatenate([d for _, d in parts]).astype(np.float64)
        want = x.astype(np.float64) @ dense.T + bias[layer]
        out = np.zeros((tokens, 326), np.float32)
        segments_gemm_kernel(x, segments, layer, gemm, out)
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(packed_linear(x, segments, layer), want, rtol=1e-4, atol=1e-4)


def _bf16_rounded(x: np.ndarray) -> np.ndarray:
    """x rounded to bfloat16 (ties to even), as float64: what MKL's bfloat16 GEMM multiplies."""
    halves = np.empty(x.shape, np.uint16)
    to_bf16(np.ascontiguousarray(x, np.float32), halves)
    return (halves.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def test_rounding_to_bf16_is_to_the_nearest_with_ties_to_even() -> None:
    # 1 + 2^-8 sits halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1); one bit more rounds up.
    # 1 + 3 * 2^-8 sits halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even): up to the even one.
    x = np.array([1.0, 1 + 2**-8, 1 + 2**-8 + 2**-20, 1 + 3 * 2**-8, -2.5, -(1 + 2**-8 + 2**-20)], np.float32)
    want = [1.0, 1.0, 1 + 2**-7, 1 + 2**-6, -2.5, -(1 + 2**-7)]
    assert _bf16_rounded(x).tolist() == want


@pytest.mark.parametrize("columns", [96, 576])
def test_the_bf16_gemm_multiplies_the_rounded_inputs_with_fp32_sums(columns: int) -> None:
    """--cpu-bf16-prefill: the same projections, each input rounded to bfloat16: against a float64 product of
    the rounded inputs it agrees to fp32 accumulation; against the exact product, to bfloat16's 8 bits.
    96 columns: tiles unpacked through fp32; 576: straight to bfloat16 (bf16_rows.py), the 300 rows two
    tiles, the second narrower than the one the chunk was packed for."""
    if not host_gemm().usable:
        pytest.skip("no MKL: projections keep the register-tile kernel")
    before = host_gemm().bf16
    try:
        assert cpu_gemm.set_bf16_mode("on") and host_gemm().bf16
        assert os.environ[cpu_gemm.BF16_RANKS_ENV] == "on"  # what the local ranks rank 0 starts will read
        parts = [random_codes(300, columns, 4, 32, 1), random_codes(20, columns, 6, 16, 3)]
        rng = np.random.default_rng(7)
        bias = rng.standard_normal((1, 320)).astype(np.float32)
        segments = segments_of([[p for p, _ in parts]], bias)
        x = rng.standard_normal((GEMM_MIN_ROWS + 3, columns)).astype(np.float32)
        dense = np.concatenate([d for _, d in parts])
        out = np.zeros((x.shape[0], 320), np.float32)
        segments_gemm_kernel(x, segments, 0, host_gemm(), out)
        rounded = _bf16_rounded(x) @ _bf16_rounded(dense).T + bias[0]
        np.testing.assert_allclose(out, rounded, rtol=1e-5, atol=1e-4)
        exact = x.astype(np.float64) @ dense.astype(np.float64).T + bias[0]
        assert np.abs(out - exact).max() > 1e-4  # the rounding shows: this is not the fp32 path
        np.testing.assert_allclose(out, exact, rtol=0, atol=0.03 * np.abs(exact).max())
        np.testing.assert_allclose(packed_linear(x, segments, 0), out, rtol=0, atol=0)
        assert not cpu_gemm.set_bf16_mode("off") and not host_gemm().bf16
        assert cpu_gemm.set_bf16_mode("auto") == cpu_gemm.has_bf16()
        with pytest.raises(ValueError, match="one of auto, on, off"):
            cpu_gemm.set_bf16_mode("fast")
    finally:
        cpu_gemm.set_bf16_mode("on" if before else "off")


def _step(context: int, chunk: int, heads: tuple[int, int], dims: tuple[int, int], seed: int) -> tuple[np.ndarray, ...]:
    """Three decode rows of request 0, then a `chunk`-row prefill of request 1 ending at `context`, over
    shuffled blocks of 16; `dims`: (K width, V width) (a latent pool when they differ)."""
    rng = np.random.default_rng(seed)
    hq, hkv = heads
    d, dv = dims
    blocks = context // 16 + 2
    planes = 1 if dv != d else 2
    pool = rng.standard_normal((planes, hkv, 2 * blocks * 16, d)).astype(np.float32)
    tables = rng.permutation(2 * blocks).astype(np.int32).reshape(2, blocks)
    row_req = np.concatenate([np.zeros(3, np.int32), np.ones(chunk, np.int32)])
    row_pos = np.concatenate([np.array([5, 6, 7], np.int32), np.arange(context - chunk, context, dtype=np.int32)])
    q = rng.standard_normal((row_req.size, hq, d)).astype(np.float32)
    return q, pool, tables, row_req, row_pos


@pytest.mark.parametrize(
    ("context", "chunk", "window", "softcap", "heads", "dims"),
    [
        (300, RUN_MIN_ROWS, 0, 0.0, (14, 2), (64, 64)),  # the coder model's heads, a chunk mid-prompt
        (130, 130, 0, 0.0, (9, 3), (64, 64)),  # a whole prompt in one chunk (the default model's heads)
        (400, 100, 37, 0.0, (4, 2), (32, 32)),  # a sliding window that cuts into the chunk
        (200, 70, 0, 30.0, (4, 1), (32, 32)),  # soft-capped scores
        (200, 70, 0, 0.0, (4, 1), (48, 32)),  # a latent pool: V is K's first channels
    ],
)
def test_blocked_attention_equals_the_paged_kernel(
    context: int, chunk: int, window: int, softcap: float, heads: tuple[int, int], dims: tuple[int, int]
) -> None:
    gemm = host_gemm()
    if not gemm.usable:
        pytest.skip("no MKL: every row takes the paged kernel")
    q, pool, tables, row_req, row_pos = _step(context, chunk, heads, dims, seed=context + chunk)
    args = (q, pool, tables, row_req, row_pos, 16, np.float32(0.125), window, np.float32(softcap))
    sinks = np.zeros(heads[0], np.float32)
    want = np.empty((q.shape[0], heads[0], dims[1]), np.float32)
    _attention_kernel(*args, sinks, False, want)
    got = np.full_like(want, np.nan)
    attend(*args, sinks, False, gemm, got)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    # The chunk's rows alone through the blocked kernel (not the row-by-row fallback).
    alone = np.full_like(want, np.nan)
    scale, cap = np.float32(0.125), np.float32(softcap)
    chunk_attention(q, pool, tables[1], 16, 3, row_pos[3], chunk, scale, window, cap, gemm, alone)
    np.testing.assert_allclose(alone[3:], want[3:], rtol=2e-5, atol=2e-5)


def test_sinks_and_short_runs_keep_the_paged_kernel() -> None:
    gemm = host_gemm()
    q, pool, tables, row_req, row_pos = _step(120, RUN_MIN_ROWS - 1, (4, 2), (32, 32), seed=3)
    sinks = np.linspace(-1, 1, 4).astype(np.float32)
    for use_sinks in (False, True):
        args = (q, pool, tables, row_req, row_pos, 16, np.float32(0.2), 0, np.float32(0.0), sinks, use_sinks)
        want = np.empty_like(q)
        _attention_kernel(*args, want)
        got = np.empty_like(q)
        attend(*args, gemm, got)
        np.testing.assert_array_equal(got, want)
