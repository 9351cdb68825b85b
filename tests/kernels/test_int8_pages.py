"""The Metal kernels on int8 KV pages (--kv-cache-dtype int8), run from their exact source in the CPU
emulator: they must attend the int8 pools as the float64 reference attends the dequantized pools.

The pools are quantized with the NumPy reference of the format (kernels/cpu/kv_quant.py): int8 codes
`[num_slots, Hkv, D]` and one float16 scale per slot and KV head. Cases are the cheap ones of cases.py.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from metalserve.executor.attention.base import AttentionBackend, AttentionCall, AttentionOptions, LayerCacheSpec
from metalserve.executor.attention.metal import KernelAttention
from metalserve.executor.attention.mlx import MlxAttention
from metalserve.executor.connector.pages import expected_shapes, supported
from metalserve.executor.step_inputs import StepInputs
from metalserve.kernels.cpu.kv_quant import dequantize, quantize
from metalserve.kernels.metal.args import PagedArgs
from metalserve.kernels.metal.guard import LaunchRefused
from metalserve.kernels.metal.paged import run_paged_attention
from tests.executor.test_attention_backends import mixed_step
from tests.kernels.cases import CASES, TOLERANCE, Case, Inputs, as_f64, make_inputs, reference_f64
from tools.msl_emulator import emulate, emulate_race_checked
from tools.msl_emulator.emulated import emulated_paged_attention

CHEAP = ("decode", "window", "sinks", "split_all_options", "mixed", "tiles_gqa4", "tiles_all_options")
PAIRS = [(c, k) for c in CASES if c.name in CHEAP for k in c.kernels]


def int8_pool(pool: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """(codes, scales `[num_slots, Hkv]`, the dequantized pool in float32) of one float pool."""
    codes, scales, _ = quantize(np.array(pool.astype(mx.float32)), "int8")
    dequantized = dequantize(codes, scales, None, "int8")
    return mx.array(codes), mx.array(scales[..., 0]), mx.array(dequantized)


def int8_args(case: Case, x: Inputs) -> tuple[PagedArgs, Inputs]:
    """The kernel's arguments on int8 pools, and the same inputs with the pools dequantized (float32)."""
    k_codes, k_scales, k_deq = int8_pool(x.k_pool)
    v_codes, v_scales, v_deq = int8_pool(x.v_pool)
    args = PagedArgs(
        x.q,
        k_codes,
        v_codes,
        x.block_tables,
        x.cu_seqlens_q,
        x.seq_lens,
        case.block_size,
        x.scale,
        case.sliding_window,
        case.softcap,
        x.sinks,
        k_scales=k_scales,
        v_scales=v_scales,
    )
    return args, replace(x, k_pool=k_deq, v_pool=v_deq)


def q4_args(case: Case, x: Inputs) -> tuple[PagedArgs, Inputs]:
    """The kernel's arguments on q4 pools (groups of 32), and the inputs with the pools dequantized."""
    parts = []
    for pool in (x.k_pool, x.v_pool):
        codes, scales, biases = quantize(np.array(pool.astype(mx.float32)), "q4", 32)
        parts.append((codes, scales, biases, dequantize(codes, scales, biases, "q4")))
    (kc, ks, kb, kd), (vc, vs, vb, vd) = parts
    args = PagedArgs(
        x.q,
        mx.array(kc),
        mx.array(vc),
        x.block_tables,
        x.cu_seqlens_q,
        x.seq_lens,
        case.block_size,
        x.scale,
        case.sliding_window,
        case.softcap,
        x.sinks,
        k_scales=mx.array(ks),
        v_scales=mx.array(vs),
        k_biases=mx.array(kb),
        v_biases=mx.array(vb),
    )
    return args, replace(x, k_pool=mx.array(kd), v_pool=mx.array(vd))


STORAGES = {"int8": int8_args, "q4": q4_args}
# q4's groups of 32 need a head dim that is a multiple of 32 (80 is not).
QUANT_PAIRS = [(s, c, k) for s in STORAGES for c, k in PAIRS if s == "int8" or c.head_dim % 32 == 0]


@pytest.mark.parametrize(
    ("storage", "case", "kernel"), QUANT_PAIRS, ids=[f"{s}-{c.name}-{k}" for s, c, k in QUANT_PAIRS]
)
def test_kernels_attend_quantized_pages_like_the_dequantized_pools(storage: str, case: Case, kernel: str) -> None:
    x = make_inputs(case)
    args, dequantized = STORAGES[storage](case, x)
    partition_size = None if kernel == "tiled" else case.partition_size
    out = run_paged_attention(args, emulate_race_checked, partition_size, kernel)
    assert out.shape == x.q.shape and out.dtype == x.q.dtype
    got = as_f64(out)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, reference_f64(case, dequantized), atol=TOLERANCE[case.dtype], rtol=0)
    # The rounding is visible: the float pools themselves give a different answer.
    assert np.abs(reference_f64(case, x) - got).max() > TOLERANCE["float32"]


def test_int8_pools_need_their_scales() -> None:
    case = PAIRS[0][0]
    args, _ = int8_args(case, make_inputs(case))
    assert args.v_scales is not None
    with pytest.raises(ValueError, match="int8 pools need k_scales"):
        replace(args, k_scales=None)
    with pytest.raises(ValueError, match="int8 pools need v_scales"):
        replace(args, v_scales=args.v_scales[:-1])


def quant_spec(storage: str, num_blocks: int = 12) -> LayerCacheSpec:
    return LayerCacheSpec.dense(2, 64, mx.float32, 8, num_blocks, storage=storage)  # type: ignore[arg-type]


def backend_step(backend: AttentionBackend[Any, Any], spec: LayerCacheSpec) -> tuple[np.ndarray, Any]:
    """Fill every slot (one long prefill), then attend a mixed step (two decodes and a prefill chunk)."""
    rng = np.random.default_rng(3)
    cache = backend.allocate(spec)
    t = spec.num_slots
    ramp = np.arange(t, dtype=np.int32)
    fill = StepInputs(
        ["x"], ramp, ramp, ramp, np.array([0, t], np.int32), np.array([t], np.int32), [np.arange(12)], [], ramp[:0]
    )
    kv = mx.array(rng.standard_normal((t, 2, 64)).astype(np.float32))
    meta = backend.build_metadata(fill, spec)
    backend.forward(AttentionCall(mx.zeros((t, 6, 64)), kv, -kv, mx.array(ramp), cache, meta, AttentionOptions(1.0)))
    step = mixed_step()
    total = len(step.slot_mapping)
    q, k, v = (mx.array(rng.standard_normal((total, h, 64)).astype(np.float32)) for h in (6, 2, 2))
    meta = backend.build_metadata(step, spec)
    call = AttentionCall(q, k, v, mx.array(step.slot_mapping), cache, meta, AttentionOptions(scale=0.125))
    return np.array(backend.forward(call)), call.cache


@pytest.mark.parametrize(
    ("storage", "code_dtype", "code_width", "groups"), [("int8", mx.int8, 64, 1), ("q4", mx.uint8, 32, 2)]
)
def test_the_metal_backend_on_quantized_pages_attends_like_mlx_ops(
    storage: str, code_dtype: mx.Dtype, code_width: int, groups: int
) -> None:
    """The Metal backend's own pools (codes + scales (+ biases), written by its forward) through the
    emulated kernels give MLX ops' answer on the same pages; the cache holds codes, not floats."""
    spec = quant_spec(storage)
    want, _ = backend_step(MlxAttention(), spec)
    got, cache = backend_step(KernelAttention(emulated_paged_attention, "emulated", "the emulated kernels"), spec)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    assert cache.k.dtype == code_dtype and cache.k.shape == (spec.num_slots, 2, code_width)
    assert cache.k_scales.dtype == mx.float16 and cache.k_scales.size == spec.num_slots * 2 * groups
    assert (cache.k_biases is not None) == (storage == "q4")
    grown = KernelAttention(emulated_paged_attention).extend(cache, quant_spec(storage, 2))
    assert grown.k.shape[0] == spec.num_slots + 16 and grown.page == cache.page
    np.testing.assert_array_equal(np.array(grown.k_scales[: spec.num_slots]), np.array(cache.k_scales))


@pytest.mark.parametrize("storage", ["int8", "q4"])
def test_the_disk_tier_stores_the_metal_backends_quantized_pools_with_their_scales(storage: str) -> None:
    """tests/executor/test_connector_metal_quant.py checks the round trip byte for byte."""
    backend = KernelAttention(emulated_paged_attention)
    cache = backend.allocate(quant_spec(storage, 2))
    assert supported(cache) and supported(backend.allocate(quant_spec("auto", 2)))
    names = set(expected_shapes([cache], 8))
    assert names == {"kv.0", "kv.0.scales"} | ({"kv.0.biases"} if storage == "q4" else set())


@pytest.mark.parametrize("storage", ["int8", "q4"])
def test_a_refused_launch_on_quantized_pages_falls_back_to_mlx_ops_on_the_dequantized_pools(storage: str) -> None:
    def refused(*args: Any, **kwargs: Any) -> mx.array:
        raise LaunchRefused("the test's GPU refuses every launch", first=True)

    spec = quant_spec(storage)
    want, _ = backend_step(MlxAttention(), spec)
    got, _ = backend_step(KernelAttention(refused, "metal", "a GPU that refuses"), spec)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


ASAN_CASE = next(c for c in CASES if c.name == "mixed")


@pytest.mark.parametrize("storage", ["int8", "q4"])
@pytest.mark.parametrize("kernel", ["tiled", "decode"])
def test_kernels_read_quantized_pools_in_bounds_under_asan(storage: str, kernel: str) -> None:
    """The AddressSanitizer build, every buffer (codes, scales, biases) in its own exact-size allocation."""
    x = make_inputs(ASAN_CASE)
    args, dequantized = STORAGES[storage](ASAN_CASE, x)
    out = run_paged_attention(args, lambda launch: emulate(launch, asan=True), None, kernel)
    want = reference_f64(ASAN_CASE, dequantized)
    np.testing.assert_allclose(as_f64(out), want, atol=TOLERANCE[ASAN_CASE.dtype], rtol=0)


@pytest.mark.parametrize(
    ("storage", "case", "kernel"), QUANT_PAIRS, ids=[f"metal-{s}-{c.name}-{k}" for s, c, k in QUANT_PAIRS]
)
def test_metal_kernels_attend_quantized_pages_like_the_dequantized_pools(storage: str, case: Case, kernel: str) -> None:
    """The same cases on a real Metal GPU (skipped without one: the emulator rows above run the source)."""
    if not mx.metal.is_available():
        pytest.skip("no Metal device here; the emulator rows run this kernel's source")
    from metalserve.kernels.metal.gpu import GUARD

    x = make_inputs(case)
    args, dequantized = STORAGES[storage](case, x)
    out = run_paged_attention(args, GUARD, None if kernel == "tiled" else case.partition_size, kernel)
    want = reference_f64(case, dequantized)
    np.testing.assert_allclose(as_f64(out), want, atol=TOLERANCE[case.dtype], rtol=0)
