"""Writing a step's K/V into the pages must not copy the pool."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from metalserve.executor.models.adapter import PagedModel
from metalserve.executor.runner import KVCacheSpec, ModelRunner
from metalserve.kernels.reference import write_kv
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


@pytest.mark.parametrize("cpu_attention", [False, True], ids=["portable", "cpu"])
def test_a_runner_step_does_not_copy_the_pools(cpu_attention: bool) -> None:
    model = tiny_model("llama")
    spec = KVCacheSpec(2, 2, 16, mx.float32, block_size=16, num_blocks=1 << 14)  # 2 x 2 x 32 MB
    runner = ModelRunner(PagedModel(model, "llama"), spec, sampler=greedy_sampler, cpu_attention=cpu_attention)
    pool_bytes = sum(a.nbytes for layer in runner.kv for a in layer.arrays())
    new = NewRequestData("r", list(range(40)), 40, SamplingParams(temperature=0), [0, 1, 2], 0)
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    runner.execute_model(SchedulerOutput([new], [], {"r": 40}, 40))
    runner.execute_model(SchedulerOutput([], [CachedRequestData("r", [], 40)], {"r": 1}, 1))  # a decode step
    assert mx.get_peak_memory() - before < pool_bytes // 20
