"""The CPU path: the numba attention kernel against the float64 reference, and the pool written in place."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from metalserve.executor.attention import mlx_ops
from metalserve.executor.attention.base import AttentionOptions
from metalserve.kernels.cpu import attention as cpu_attention
from metalserve.kernels.cpu.paged import build_cpu_plan, cpu_paged_attention, host_view
from tests.kernels.cases import CASES, Case, as_f64, make_inputs, reference_f64


def _f32(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_kernel_matches_float64_reference(case: Case) -> None:
    """Every contract case: decodes, prefill chunks after cached context, GQA ratios, windows, softcap,
    sinks, head dims, block sizes. Inputs of other dtypes are upcast to float32, so float32's tolerance."""
    x = make_inputs(case)
    pool = _f32(mlx_ops.portable_pool(x.k_pool, x.v_pool))
    sinks = None if x.sinks is None else _f32(x.sinks)
    got = cpu_attention.paged_attention(
        _f32(x.q),
        pool,
        np.array(x.block_tables),
        np.array(x.cu_seqlens_q),
        np.array(x.seq_lens),
        block_size=case.block_size,
        scale=x.scale,
        sliding_window=case.sliding_window,
        softcap=case.softcap,
        sinks=sinks,
    )
    np.testing.assert_allclose(got, reference_f64(case, x), atol=2e-5, rtol=0)


def test_query_rows_place_each_chunk_after_its_cached_prefix() -> None:
    req, pos = cpu_attention.query_rows(np.array([0, 1, 4, 5]), np.array([9, 3, 20]))
    assert req.tolist() == [0, 1, 1, 1, 2] and pos.tolist() == [8, 0, 1, 2, 19]


def test_kernel_rejects_other_dtypes_and_head_ratios() -> None:
    q = np.zeros((1, 4, 8), np.float32)
    pool = np.zeros((2, 3, 16, 8), np.float32)
    table, lens = np.zeros((1, 1), np.int32), np.ones(1, np.int32)
    cu = np.array([0, 1], np.int32)
    with pytest.raises(TypeError, match="float32"):
        cpu_attention.paged_attention(q.astype(np.float16), pool, table, cu, lens, block_size=16, scale=1.0)
    with pytest.raises(ValueError, match="not a multiple"):
        cpu_attention.paged_attention(q, pool, table, cu, lens, block_size=16, scale=1.0)


def test_host_view_writes_reach_the_mlx_pool() -> None:
    pool = mx.zeros((2, 2, 8, 4))
    view = host_view(pool)
    k = np.arange(2 * 2 * 4, dtype=np.float32).reshape(2, 2, 4)
    cpu_attention.write_kv(view, k, -k, np.array([5, 1]))
    got = np.array(pool)
    np.testing.assert_array_equal(got[0, :, 5], k[0])
    np.testing.assert_array_equal(got[1, :, 1], -k[1])
    assert np.count_nonzero(got) == np.count_nonzero(k) + np.count_nonzero(-k)


def test_host_view_refuses_a_half_precision_pool() -> None:
    with pytest.raises(RuntimeError, match="float32"):
        host_view(mx.zeros((2, 1, 4, 4), mx.float16))


def test_mixed_step_writes_then_attends_like_the_portable_path() -> None:
    """Two decodes and a prefill chunk after cached context: the new K/V land in the pool and every row
    matches the portable path."""
    rng = np.random.default_rng(7)
    hkv, hq, d, bs, num_blocks = 2, 6, 16, 8, 12
    pool = mx.array(rng.standard_normal((2, hkv, num_blocks * bs, d)).astype(np.float32))
    portable = mx.array(np.array(pool))  # a separate copy for the portable path
    rows = [np.array([3, 7]), np.array([0]), np.array([9, 2, 5])]
    q_lens, seq_lens = [1, 1, 6], np.array([12, 5, 20], np.int32)
    cu = np.cumsum([0, *q_lens]).astype(np.int32)
    positions = np.concatenate([np.arange(n - q, n) for q, n in zip(q_lens, seq_lens, strict=True)])
    owner = np.repeat(np.arange(3), q_lens)
    slots = np.array([rows[r][p // bs] * bs + p % bs for r, p in zip(owner, positions, strict=True)], np.int32)
    total = int(cu[-1])
    q = mx.array(rng.standard_normal((total, hq, d)).astype(np.float32))
    k = mx.array(rng.standard_normal((total, hkv, d)).astype(np.float32))
    v = mx.array(rng.standard_normal((total, hkv, d)).astype(np.float32))
    opts = AttentionOptions(scale=d**-0.5)

    padded = np.array([[3, 7, 0], [0, 0, 0], [9, 2, 5]], np.int32)  # as StepInputs.padded_block_tables pads
    step = build_cpu_plan(padded, cu, seq_lens, slots, bs)
    assert step.block_tables.tolist() == [[3, 7, 0], [0, 0, 0], [9, 2, 5]]
    assert step.row_req.tolist() == [0, 1] + [2] * 6 and step.row_pos.tolist() == [11, 4, *range(14, 20)]
    got = cpu_paged_attention(q, k, v, host_view(pool), step, opts)

    portable = mlx_ops.write_kv_portable(portable, k, v, mx.array(slots))
    plan = mlx_ops.build_plan(rows, cu, seq_lens, bs, num_kv_heads=hkv)
    want = mlx_ops.paged_attention_planned(q, portable, plan, opts)
    np.testing.assert_array_equal(np.array(pool), np.array(portable))
    np.testing.assert_allclose(as_f64(got), as_f64(want), atol=2e-5, rtol=0)


def test_the_softmax_exp_is_as_accurate_as_float32_allows() -> None:
    from metalserve.kernels.cpu.attention import _exp_rows

    x = -np.linspace(0.0, 100.0, 20001, dtype=np.float32)[None].repeat(2, axis=0)
    want = np.exp(x.astype(np.float64))
    _exp_rows(x, x.shape[1] - 7, np.empty(x.shape[1], np.int32))  # not the last 7: they stay as given
    live = want[:, :-7] >= np.exp(-64.0)  # below it the weights are flushed to 0 (fast_exp.FLUSH_BELOW)
    relative = np.abs(x[:, :-7][live] - want[:, :-7][live]) / want[:, :-7][live]
    assert relative.max() < 2e-7
    assert not x[:, :-7][~live].any()
    np.testing.assert_array_equal(x[:, -7:], -np.linspace(0.0, 100.0, 20001, dtype=np.float32)[-7:][None].repeat(2, 0))
