"""The attention seam: every backend allocates, plans, writes and attends one mixed step alike."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from metalserve.executor.attention import mlx_ops
from metalserve.executor.attention.base import AttentionBackend, AttentionCall, AttentionOptions, LayerCacheSpec
from metalserve.executor.attention.cpu import CpuAttention
from metalserve.executor.attention.metal import KernelAttention
from metalserve.executor.attention.mlx import MlxAttention
from metalserve.executor.step_inputs import StepInputs

BACKENDS = [MlxAttention(), CpuAttention(), KernelAttention(mlx_ops.paged_attention, "contract", "the contract")]
IDS = ["mlx", "cpu", "kernel-contract"]
SPEC = LayerCacheSpec.dense(num_kv_heads=2, head_dim=16, dtype=mx.float32, block_size=8, num_blocks=12)


def mixed_step() -> StepInputs:
    """Two decodes and a prefill chunk after cached context, as pack_step lays them out."""
    rows = [np.array([3, 7]), np.array([0]), np.array([9, 2, 5])]
    q_lens, seq_lens = [1, 1, 6], np.array([12, 5, 20], np.int32)
    positions = np.concatenate([np.arange(n - q, n) for q, n in zip(q_lens, seq_lens, strict=True)])
    owner = np.repeat(np.arange(3), q_lens)
    slots = np.array([rows[r][p // 8] * 8 + p % 8 for r, p in zip(owner, positions, strict=True)], np.int32)
    return StepInputs(
        request_ids=["a", "b", "c"],
        token_ids=np.zeros(8, np.int32),
        positions=positions.astype(np.int32),
        slot_mapping=slots,
        cu_seqlens_q=np.cumsum([0, *q_lens]).astype(np.int32),
        seq_lens=seq_lens,
        block_rows=rows,
        sampling_rows=[0, 1, 2],
        logits_indices=np.array([0, 1, 7], np.int32),
    )


def k_of(backend: AttentionBackend[Any, Any], cache: Any) -> np.ndarray:
    """The K pool as `[slots, Hkv, D]`, whatever the backend's layout."""
    arrays = cache.arrays()
    return np.array(arrays[0]) if len(arrays) == 2 else np.array(arrays[0][0]).transpose(1, 0, 2)


def filled(backend: AttentionBackend[Any, Any], rng: np.random.Generator) -> Any:
    """A cache whose every slot holds earlier K/V: one step of a request that owns every block."""
    cache = backend.allocate(SPEC)
    t = SPEC.num_slots
    ramp = np.arange(t, dtype=np.int32)
    step = StepInputs(
        ["x"],
        ramp,
        ramp,
        ramp,
        np.array([0, t], np.int32),
        np.array([t], np.int32),
        [np.arange(SPEC.num_blocks)],
        [],
        np.array([], np.int32),
    )
    kv = mx.array(rng.standard_normal((t, 2, 16)).astype(np.float32))
    meta = backend.build_metadata(step, SPEC)
    backend.forward(AttentionCall(mx.zeros((t, 6, 16)), kv, -kv, mx.array(ramp), cache, meta, AttentionOptions(1.0)))
    return cache


def run_step(backend: AttentionBackend[Any, Any], seed: int = 7) -> tuple[np.ndarray, Any]:
    rng = np.random.default_rng(seed)
    cache = filled(backend, rng)
    step = mixed_step()
    meta = backend.build_metadata(step, SPEC)
    total = len(step.slot_mapping)
    q = mx.array(rng.standard_normal((total, 6, 16)).astype(np.float32))
    k = mx.array(rng.standard_normal((total, 2, 16)).astype(np.float32))
    v = mx.array(rng.standard_normal((total, 2, 16)).astype(np.float32))
    call = AttentionCall(q, k, v, mx.array(step.slot_mapping), cache, meta, AttentionOptions(scale=0.25))
    out = np.array(backend.forward(call))
    np.testing.assert_array_equal(k_of(backend, call.cache)[step.slot_mapping], np.array(k))  # written in place
    return out, call.cache


@pytest.mark.parametrize("backend", BACKENDS, ids=IDS)
def test_every_backend_attends_a_mixed_step_like_mlx_ops(backend: AttentionBackend[Any, Any]) -> None:
    want, _ = run_step(MlxAttention())
    got, _ = run_step(backend)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS, ids=IDS)
def test_extending_a_cache_keeps_its_slots_and_adds_zeroed_ones(backend: AttentionBackend[Any, Any]) -> None:
    _, cache = run_step(backend)
    before = k_of(backend, cache)
    more = LayerCacheSpec.dense(2, 16, mx.float32, 8, num_blocks=4)
    grown = backend.extend(cache, more)
    mx.eval(grown.arrays())
    after = k_of(backend, grown)
    assert after.shape[0] == (12 + 4) * 8
    np.testing.assert_array_equal(after[: 12 * 8], before)
    assert not after[12 * 8 :].any()


def test_the_cpu_backend_remakes_its_host_views_when_a_pool_grows() -> None:
    backend = CpuAttention()
    cache = backend.allocate(SPEC)
    grown = backend.extend(cache, LayerCacheSpec.dense(2, 16, mx.float32, 8, num_blocks=4))
    assert grown.host.shape == (2, 2, 16 * 8, 16) and np.shares_memory(grown.host, np.asarray(grown.pool))
    grown.host[0, 1, 120] = 3.0  # a slot of the grown part (96..127), written through the view, reaches MLX's pool
    assert float(grown.pool[0, 1, 120, 0]) == 3.0


def test_the_cpu_backend_refuses_a_half_precision_pool() -> None:
    with pytest.raises(ValueError, match="float32"):
        CpuAttention().allocate(LayerCacheSpec.dense(2, 16, mx.float16, 8, 4))
