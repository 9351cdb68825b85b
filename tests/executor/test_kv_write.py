"""Writing a step's K/V into the pages must not copy the pool."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from metalserve.executor.attention.base import AttentionBackend
from metalserve.executor.attention.cpu import CpuAttention
from metalserve.executor.attention.mlx import MlxAttention
from metalserve.executor.attention.mlx_ops import write_kv
from metalserve.executor.models.adapter import PagedModel
from metalserve.executor.runner import ModelRunner
from metalserve.kvcache.specs import KVCacheSpec
from metalserve.sampling_params import SamplingParams
from metalserve.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput
from tests.executor.tiny_models import greedy_sampler, tiny_model


def test_write_kv_puts_rows_at_their_slots() -> None:
    k = mx.zeros((64, 2, 4))
    v = mx.zeros((64, 2, 4))
    new = mx.arange(3 * 2 * 4, dtype=mx.float32).reshape(3, 2, 4) + 1
    slots = mx.array([5, 63, 17], dtype=mx.int32)
    k, v = write_kv(k, v, new, -new, slots)
    got_k, got_v, want = np.array(k), np.array(v), np.array(new)
    np.testing.assert_array_equal(got_k[[5, 63, 17]], want)
    np.testing.assert_array_equal(got_v[[5, 63, 17]], -want)
    others = np.setdiff1d(np.arange(64), [5, 63, 17])
    assert not got_k[others].any() and not got_v[others].any()


def test_write_kv_does_not_copy_the_pool() -> None:
    slots = 1 << 18  # a 200 MB pool per tensor
    k, v = mx.zeros((slots, 3, 64)), mx.zeros((slots, 3, 64))
    mx.eval(k, v)
    new = mx.ones((32, 3, 64))
    mapping = mx.arange(32, dtype=mx.int32) * 9
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    for _ in range(3):
        k, v = write_kv(k, v, new, new, mapping)
        mx.eval(k, v)
    assert mx.get_peak_memory() - before < k.nbytes // 100


@pytest.mark.parametrize("backend", [MlxAttention(), CpuAttention()], ids=["mlx", "cpu"])
def test_a_runner_step_does_not_copy_the_pools(backend: AttentionBackend) -> None:  # type: ignore[type-arg]
    model = tiny_model("llama")
    spec = KVCacheSpec.uniform(2, 2, 16, "float32", 4, block_size=16, num_blocks=1 << 14)  # 2 x 2 x 32 MB
    runner = ModelRunner(PagedModel(model, "llama"), spec, sampler=greedy_sampler, backend=backend)
    pool_bytes = sum(a.nbytes for layer in runner.kv for a in layer.arrays())
    new = NewRequestData("r", list(range(40)), 40, SamplingParams(temperature=0), ([0, 1, 2],), 0)
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    runner.execute_model(SchedulerOutput([new], [], {"r": 40}, 40))
    runner.execute_model(SchedulerOutput([], [CachedRequestData("r", ([],), 40)], {"r": 1}, 1))  # a decode step
    assert mx.get_peak_memory() - before < pool_bytes // 20


@pytest.mark.parametrize("backend", [MlxAttention(), CpuAttention()], ids=["mlx", "cpu"])
def test_a_grown_pool_keeps_its_blocks_and_decodes_on(backend: AttentionBackend) -> None:  # type: ignore[type-arg]
    """The scheduler grows the pool (SchedulerOutput.num_kv_blocks): each backend's cache extends itself,
    the CPU backend with fresh host views, and a request whose blocks straddle the old end decodes as in
    a pool that was that large from the start."""
    prompt = list(range(3, 40))
    params = SamplingParams(temperature=0)
    tokens = {}
    for start_blocks in (4, 8):
        spec = KVCacheSpec.uniform(2, 2, 16, "float32", 4, block_size=16, num_blocks=start_blocks)
        runner = ModelRunner(PagedModel(tiny_model("llama"), "llama"), spec, sampler=greedy_sampler, backend=backend)
        new = NewRequestData("r", prompt, 37, params, ([1, 2, 3],), 0)
        out = runner.execute_model(SchedulerOutput([new], [], {"r": 37}, 37))
        before = [np.array(a) for layer in runner.kv for a in layer.arrays()]
        grow = SchedulerOutput([], [CachedRequestData("r", ([6],), 37)], {"r": 1}, 1, num_kv_blocks=8)
        steps = [out.sampled_token_ids["r"][0], runner.execute_model(grow).sampled_token_ids["r"][0]]
        assert runner.spec.num_blocks == 8
        for old, pool in zip(before, [a for layer in runner.kv for a in layer.arrays()], strict=True):
            assert pool.shape[2] == 8 * 16  # [2, Hkv, slots, D]
            np.testing.assert_array_equal(np.array(pool)[:, :, 16:37], old[:, :, 16:37])  # the prompt's K/V
        if isinstance(backend, CpuAttention):
            assert all(np.shares_memory(layer.host, np.asarray(layer.pool)) for layer in runner.kv)
        for n in range(38, 54):  # positions 48.. go to block 6, slots 96..111: past the old end
            out = runner.execute_model(SchedulerOutput([], [CachedRequestData("r", ([],), n)], {"r": 1}, 1))
            steps.append(out.sampled_token_ids["r"][0])
        tokens[start_blocks] = steps
    assert tokens[4] == tokens[8]
