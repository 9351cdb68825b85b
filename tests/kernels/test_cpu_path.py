"""The CPU path: the numba decode kernel against the float64 reference, and the pool written in place."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from metalserve.kernels import cpu_decode, reference
from metalserve.kernels.cpu import build_cpu_plan, cpu_paged_attention, host_view
from tests.kernels.cases import CASES, Case, Inputs, as_f64, make_inputs, reference_f64


def _num_decodes(x: Inputs) -> int:
    q_lens = np.diff(np.array(x.cu_seqlens_q))
    n = 0
    while n < len(q_lens) and q_lens[n] == 1:
        n += 1
    return n


def _f32(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32))


DECODE_CASES = [c for c in CASES if _num_decodes(make_inputs(c))]


@pytest.mark.parametrize("case", DECODE_CASES, ids=[c.name for c in DECODE_CASES])
def test_decode_kernel_matches_float64_reference(case: Case) -> None:
    """Every option (GQA ratios, windows, softcap, sinks, head dims, block sizes) on the leading decodes.

    Inputs of other dtypes are upcast to float32 first, so the tolerance is float32's.
    """
    x = make_inputs(case)
    n = _num_decodes(x)
    pool = _f32(reference.portable_pool(x.k_pool, x.v_pool))
    sinks = None if x.sinks is None else _f32(x.sinks)
    got = cpu_decode.decode_attention(
        _f32(x.q)[:n], pool, np.array(x.block_tables)[:n], np.array(x.seq_lens)[:n], block_size=case.block_size,
        scale=x.scale, sliding_window=case.sliding_window, softcap=case.softcap, sinks=sinks,
    )  # fmt: skip
    np.testing.assert_allclose(got, reference_f64(case, x)[:n], atol=2e-5, rtol=0)


def test_decode_kernel_rejects_other_dtypes_and_head_ratios() -> None:
    q = np.zeros((1, 4, 8), np.float32)
    pool = np.zeros((2, 3, 16, 8), np.float32)
    table, lens = np.zeros((1, 1), np.int32), np.ones(1, np.int32)
    with pytest.raises(TypeError, match="float32"):
        cpu_decode.decode_attention(q.astype(np.float16), pool, table, lens, block_size=16, scale=1.0)
    with pytest.raises(ValueError, match="not a multiple"):
        cpu_decode.decode_attention(q, pool, table, lens, block_size=16, scale=1.0)


def test_host_view_writes_reach_the_mlx_pool() -> None:
    pool = mx.zeros((2, 2, 8, 4))
    view = host_view(pool)
    k = np.arange(2 * 2 * 4, dtype=np.float32).reshape(2, 2, 4)
    cpu_decode.write_kv(view, k, -k, np.array([5, 1]))
    got = np.array(pool)
    np.testing.assert_array_equal(got[0, :, 5], k[0])
    np.testing.assert_array_equal(got[1, :, 1], -k[1])
    assert np.count_nonzero(got) == np.count_nonzero(k) + np.count_nonzero(-k)


def test_host_view_refuses_a_half_precision_pool() -> None:
    with pytest.raises(RuntimeError, match="float32"):
        host_view(mx.zeros((2, 1, 4, 4), mx.float16))


def test_mixed_step_writes_then_attends_like_the_portable_path() -> None:
    """Two decodes and a prefill chunk: the new K/V land in the pool and every row matches the portable path."""
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
    opts = reference.AttentionOptions(scale=d**-0.5)

    step = build_cpu_plan(rows, cu, seq_lens, slots, bs)
    assert step.num_decodes == 2 and step.block_tables.tolist() == [[3, 7], [0, 0]]
    prefills = reference.build_plan(rows, cu, seq_lens, bs, num_kv_heads=hkv, with_decodes=False)
    assert prefills.decodes == () and len(prefills.prefills) == 1
    got = cpu_paged_attention(q, k, v, pool, host_view(pool), step, prefills, opts)

    portable = reference.write_kv_portable(portable, k, v, mx.array(slots))
    plan = reference.build_plan(rows, cu, seq_lens, bs, num_kv_heads=hkv)
    want = reference.paged_attention_planned(q, portable, plan, opts)
    np.testing.assert_array_equal(np.array(pool), np.array(portable))
    np.testing.assert_allclose(as_f64(got), as_f64(want), atol=2e-5, rtol=0)
