"""Quantized KV pages: the formats against their NumPy reference, and attention over quantized pages
against the reference attending the dequantized ones."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from metalserve.executor.attention import kv_quant, mlx_ops
from metalserve.executor.attention.base import AttentionBackend, AttentionCall, AttentionOptions, LayerCacheSpec
from metalserve.executor.attention.cpu import CpuAttention
from metalserve.executor.attention.kv_quant import QuantPool
from metalserve.executor.attention.mlx import MlxAttention
from metalserve.executor.step_inputs import StepInputs
from metalserve.kernels.cpu import kv_quant as np_quant
from metalserve.kvcache.specs import PageDtype, SlidingWindow
from tests.executor.test_attention_backends import mixed_step

STORAGES = ["int8", "q4"]


def page(storage: str, group: int = 64) -> PageDtype:
    return PageDtype("float32", 4, storage, group)  # type: ignore[arg-type]


def vectors(seed: int = 0, shape: tuple[int, ...] = (5, 3, 64)) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.1, 8, size=(*shape[:-1], 1)).astype(np.float32)
    x[0, 0] = 0.0  # an all-zero vector: scale 0, decoded exactly
    return x


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("group", [32, 64])
def test_mlx_quantize_matches_the_numpy_reference_within_the_format_s_error(storage: str, group: int) -> None:
    x = vectors()
    codes, scales, biases = np_quant.quantize(x, storage, group)
    got_codes, got_scales, got_biases = kv_quant.quantize(mx.array(x), page(storage, group))
    np.testing.assert_array_equal(np.array(got_scales), scales)
    # Codes agree except where a value sits on a rounding tie (then they differ by one step).
    diff = np.abs(np.array(got_codes).astype(np.int32) - codes.astype(np.int32))
    assert diff.max() <= (1 if storage == "int8" else 0x11) and (diff != 0).mean() < 1e-3
    back = np_quant.dequantize(codes, scales, biases, storage)
    np.testing.assert_array_equal(back[0, 0], 0.0)
    if storage == "int8":
        bound = np.abs(x).max(axis=-1, keepdims=True) / 254 * 1.01 + 1e-7  # half a step, fp16 scale
        assert biases is None and got_biases is None and codes.dtype == np.int8 and scales.shape == (5, 3, 1)
    else:
        assert biases is not None and got_biases is not None
        np.testing.assert_array_equal(np.array(got_biases), biases)
        xg = x.reshape(5, 3, 64 // group, group)
        spread = xg.max(axis=-1, keepdims=True) - xg.min(axis=-1, keepdims=True)
        # half a step, plus float16's rounding of the bias (the group's minimum)
        step_err = spread / 30 * 1.01 + np.abs(xg.min(axis=-1, keepdims=True)) * 2**-11
        bound = np.broadcast_to(step_err, xg.shape).reshape(x.shape)
        assert codes.dtype == np.uint8 and codes.shape == (5, 3, 32) and scales.shape == (5, 3, 64 // group)
    assert np.all(np.abs(back - x) <= bound + 1e-6)
    mlx_back = np.array(kv_quant.dequantize(got_codes, got_scales, got_biases, page(storage, group), mx.float32))
    assert np.all(np.abs(mlx_back - x) <= bound + 1e-6)


def test_int8_keeps_about_two_and_a_half_significant_digits_and_q4_one() -> None:
    x = vectors(3, (64, 4, 128))
    errs = {}
    for storage in STORAGES:
        back = np_quant.dequantize(*np_quant.quantize(x, storage), storage)
        errs[storage] = float(np.linalg.norm(back - x) / np.linalg.norm(x))
    assert errs["int8"] < 0.01 and errs["q4"] < 0.12, errs


SPEC = LayerCacheSpec.dense(num_kv_heads=2, head_dim=32, dtype=mx.float32, block_size=8, num_blocks=12)


def quant_spec(storage: str) -> LayerCacheSpec:
    return LayerCacheSpec.dense(2, 32, mx.float32, 8, 12, storage=storage)  # type: ignore[arg-type]


def run_quantized_step(storage: str, opts: AttentionOptions, seed: int = 5) -> tuple[np.ndarray, np.ndarray, Any]:
    """A cache of `storage` pages filled with earlier K/V, then one mixed step: (output, q, cache)."""
    backend = MlxAttention()
    spec = quant_spec(storage)
    rng = np.random.default_rng(seed)
    cache = backend.allocate(spec)
    slots = spec.num_slots
    kv = mx.array(rng.standard_normal((slots, 2, 32)).astype(np.float32))
    everything = mx.array(np.arange(slots, dtype=np.int32))
    assert isinstance(cache.pool, QuantPool)
    cache.pool.write(mx.stack([kv, -kv]), everything)
    step = mixed_step()
    total = len(step.slot_mapping)
    q = rng.standard_normal((total, 6, 32)).astype(np.float32)
    k = mx.array(rng.standard_normal((total, 2, 32)).astype(np.float32))
    v = mx.array(rng.standard_normal((total, 2, 32)).astype(np.float32))
    meta = backend.build_metadata(step, spec)
    call = AttentionCall(mx.array(q), k, v, mx.array(step.slot_mapping), cache, meta, opts)
    return np.array(backend.forward(call)), q, cache


OPTIONS = {
    "plain": AttentionOptions(scale=0.25),
    "window": AttentionOptions(scale=0.25, sliding_window=5),
    "softcap-sinks": AttentionOptions(scale=0.25, softcap=5.0, sinks=mx.array(np.linspace(-1, 1, 6, dtype=np.float32))),
}


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("opts", OPTIONS.values(), ids=OPTIONS.keys())
def test_mlx_ops_attend_quantized_pages_like_the_reference_attends_their_dequantized_values(
    storage: str, opts: AttentionOptions
) -> None:
    got, q, cache = run_quantized_step(storage, opts)
    pool = cache.pool
    dense = pool.take(mx.array(np.arange(SPEC.num_slots, dtype=np.int32)))  # [2, Hkv, slots, D] floats
    # The dequantized pool is the NumPy reference's decoding of the NumPy reference's codes.
    codes = [np.array(a) for a in pool.arrays()]
    want_dense = np_quant.dequantize(codes[0], codes[1], codes[2] if len(codes) > 2 else None, storage)
    np.testing.assert_allclose(np.array(dense), want_dense, atol=1e-6, rtol=0)
    step = mixed_step()
    plan = MlxAttention().build_metadata(step, SPEC)
    want = np.array(mlx_ops.paged_attention_planned(mx.array(q), dense, plan, opts))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("storage", STORAGES)
def test_quantized_attention_stays_near_full_precision(storage: str) -> None:
    """The error the storage brings: against the same K/V kept in float32."""
    got, q, _ = run_quantized_step(storage, OPTIONS["plain"])
    backend = MlxAttention()
    rng = np.random.default_rng(5)
    cache = backend.allocate(SPEC)
    kv = mx.array(rng.standard_normal((SPEC.num_slots, 2, 32)).astype(np.float32))
    cache.pool = mlx_ops.write_kv_portable(cache.pool, kv, -kv, mx.array(np.arange(SPEC.num_slots, dtype=np.int32)))
    step = mixed_step()
    total = len(step.slot_mapping)
    rng.standard_normal((total, 6, 32))  # q, drawn as run_quantized_step drew it
    k = mx.array(rng.standard_normal((total, 2, 32)).astype(np.float32))
    v = mx.array(rng.standard_normal((total, 2, 32)).astype(np.float32))
    meta = backend.build_metadata(step, SPEC)
    exact = np.array(
        backend.forward(AttentionCall(mx.array(q), k, v, mx.array(step.slot_mapping), cache, meta, OPTIONS["plain"]))
    )
    assert np.abs(got - exact).max() < (0.05 if storage == "int8" else 0.4)


@pytest.mark.parametrize("storage", STORAGES)
def test_a_quantized_pool_grows_keeping_its_pages_and_costs_what_the_spec_says(storage: str) -> None:
    backend = MlxAttention()
    spec = quant_spec(storage)
    _, _, cache = run_quantized_step(storage, OPTIONS["plain"])
    before = [np.array(a) for a in cache.arrays()]
    assert sum(a.nbytes for a in before) == spec.attn.page_bytes(spec.block_size) * spec.num_blocks
    more = LayerCacheSpec(spec.attn, spec.block_size, 4)
    grown = backend.extend(cache, more)
    mx.eval(grown.arrays())
    for old, new in zip(before, grown.arrays(), strict=True):
        np.testing.assert_array_equal(np.array(new)[:, :, : spec.num_slots], old)
        assert not np.array(new)[:, :, spec.num_slots :].any()
    assert grown.pool.shape == (2, 2, 16 * 8, 32)


def _filled_step(spec: LayerCacheSpec) -> StepInputs:
    """One request owning every block, one step over every slot (fills the pages)."""
    t = spec.num_slots
    ramp = np.arange(t, dtype=np.int32)
    return StepInputs(
        ["x"],
        ramp,
        ramp,
        ramp,
        np.array([0, t], np.int32),
        np.array([t], np.int32),
        [np.arange(spec.num_blocks)],
        [],
        np.array([], np.int32),
    )


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("backend", [MlxAttention(), CpuAttention()], ids=["mlx", "cpu"])
@pytest.mark.parametrize("opts", OPTIONS.values(), ids=OPTIONS.keys())
def test_each_backend_attends_its_quantized_pages_like_the_reference_attends_them_dequantized(
    storage: str, backend: AttentionBackend[Any, Any], opts: AttentionOptions
) -> None:
    spec = quant_spec(storage)
    if opts.sliding_window is not None:  # the MLX-ops plan masks by the group's spec, the kernels by opts
        window = SlidingWindow(opts.sliding_window, num_kv_heads=2, head_dim=32, page=spec.page)
        spec = LayerCacheSpec(window, spec.block_size, spec.num_blocks)
    rng = np.random.default_rng(11)
    cache = backend.allocate(spec)
    fill = _filled_step(spec)
    kv = mx.array(rng.standard_normal((spec.num_slots, 2, 32)).astype(np.float32))
    backend.forward(
        AttentionCall(
            mx.zeros((spec.num_slots, 6, 32)),
            kv,
            -kv,
            mx.array(fill.slot_mapping),
            cache,
            backend.build_metadata(fill, spec),
            AttentionOptions(1.0),
        )
    )
    step = mixed_step()
    total = len(step.slot_mapping)
    q = mx.array(rng.standard_normal((total, 6, 32)).astype(np.float32))
    k, v = (mx.array(rng.standard_normal((total, 2, 32)).astype(np.float32)) for _ in range(2))
    call = AttentionCall(q, k, v, mx.array(step.slot_mapping), cache, backend.build_metadata(step, spec), opts)
    got = np.array(backend.forward(call))
    arrays = [np.array(a) for a in call.cache.arrays()]
    dense = np_quant.dequantize(arrays[0], arrays[1], arrays[2] if len(arrays) > 2 else None, storage)
    written = dense[:, :, step.slot_mapping].transpose(0, 2, 1, 3)  # this step's K/V, as stored
    bound = 0.05 if storage == "int8" else 0.5
    assert np.abs(written[0] - np.array(k)).max() < bound and np.abs(written[1] - np.array(v)).max() < bound
    plan = MlxAttention().build_metadata(step, LayerCacheSpec(replace(spec.attn, page=PageDtype()), 8, 12))
    want = np.array(mlx_ops.paged_attention_planned(q, mx.array(dense), plan, opts))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
