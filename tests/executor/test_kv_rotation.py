"""Quantized pages in the Hadamard-rotated basis (executor/attention/rotation.py): the rotation is
orthonormal and its own inverse, attention through it is the same function of the unquantized K/V, the
pages hold rotated vectors, and keys with outlier channels lose several times less to quantization."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from metalserve.executor.attention.base import AttentionBackend, AttentionCall, AttentionOptions, LayerCacheSpec
from metalserve.executor.attention.cpu import CpuAttention
from metalserve.executor.attention.mlx import MlxAttention
from metalserve.executor.attention.rotation import RotatedPages, hadamard
from metalserve.executor.attention.select import select_attention
from metalserve.kernels.cpu import kv_quant as np_quant
from metalserve.platform import Platform
from tests.executor.test_kv_quant import _filled_step

D = 64
OPTS = AttentionOptions(scale=D**-0.5)


@pytest.mark.parametrize("dim", [64, 128, 256, 80, 96, 72])
def test_the_rotation_is_orthonormal_symmetric_and_its_own_inverse(dim: int) -> None:
    h = hadamard(dim)
    np.testing.assert_allclose(h @ h.T, np.eye(dim), atol=1e-12)
    np.testing.assert_array_equal(h, h.T)
    block = dim & -dim  # every entry of a block is +-1/sqrt(block): no channel is left out of the mix
    assert np.count_nonzero(h) == dim * block and np.allclose(np.abs(h[h != 0]), block**-0.5)


@pytest.mark.parametrize("dim", [64, 128, 80, 96])
def test_the_wrapper_rotates_by_that_matrix_whichever_way_it_computes_it(dim: int) -> None:
    x = np.random.default_rng(dim).standard_normal((7, 3, dim)).astype(np.float32)
    got = np.array(RotatedPages(MlxAttention()).rotate(mx.array(x)))
    np.testing.assert_allclose(got, x @ hadamard(dim), atol=1e-5)


def keys_with_outliers(rng: np.random.Generator, n: int) -> np.ndarray:
    """`[n, 2, D]`: unit-scale channels plus two RoPE-like outlier channels 40x larger, as real keys have."""
    x = rng.standard_normal((n, 2, D)).astype(np.float32)
    x[..., 3] *= 40
    x[..., 3 + D // 2] *= 40
    return x


def spec(storage: str) -> LayerCacheSpec:
    return LayerCacheSpec.dense(2, D, mx.float32, 8, 12, storage=storage)  # type: ignore[arg-type]


def attend_all(backend: AttentionBackend[Any, Any], storage: str, seed: int = 3) -> tuple[np.ndarray, Any, np.ndarray]:
    """One request's 96 tokens in one step over `storage` pages: (output, cache, keys)."""
    layer = spec(storage)
    rng = np.random.default_rng(seed)
    step = _filled_step(layer)
    n = layer.num_slots
    k = keys_with_outliers(rng, n)
    v = rng.standard_normal((n, 2, D)).astype(np.float32)
    q = rng.standard_normal((n, 6, D)).astype(np.float32)
    cache = backend.allocate(layer)
    meta = backend.build_metadata(step, layer)
    call = AttentionCall(mx.array(q), mx.array(k), mx.array(v), mx.array(step.slot_mapping), cache, meta, OPTS)
    return np.array(backend.forward(call)), call.cache, k


@pytest.mark.parametrize("storage", ["int8", "q4"])
@pytest.mark.parametrize("inner", [MlxAttention, CpuAttention], ids=["mlx", "cpu"])
def test_rotated_pages_attend_closer_to_full_precision_than_plain_ones(storage: str, inner: type) -> None:
    exact, _, _ = attend_all(inner(), "auto")
    plain, _, _ = attend_all(inner(), storage)
    rotated, cache, k = attend_all(RotatedPages(inner()), storage)
    err_plain, err_rotated = np.abs(plain - exact).mean(), np.abs(rotated - exact).mean()
    assert err_rotated < err_plain / 2, (err_rotated, err_plain)
    # The pages hold K in the rotated basis: decoded, they are k @ H (to the format's error), not k.
    arrays = [np.array(a) for a in cache.arrays()]
    stored = np_quant.dequantize(arrays[0], arrays[1], arrays[2] if len(arrays) > 2 else None, storage)[0]
    want = (k @ hadamard(D)).transpose(1, 0, 2)
    step_size = np.abs(want).max() / (10 if storage == "q4" else 100)
    assert np.abs(stored - want).max() < step_size < np.abs(stored - k.transpose(1, 0, 2)).max()


def test_float_pages_and_latents_pass_through_unrotated() -> None:
    seen: list[AttentionCall[Any, Any]] = []

    class Recorder(MlxAttention):
        def forward(self, call: AttentionCall[Any, Any]) -> mx.array:
            seen.append(call)
            return super().forward(call)

    exact, _, _ = attend_all(MlxAttention(), "auto")
    wrapped, _, k = attend_all(RotatedPages(Recorder()), "auto")  # float pages: nothing to rotate
    np.testing.assert_array_equal(wrapped, exact)
    np.testing.assert_array_equal(np.array(seen[0].k), k)
    latent = seen[0]._replace(v=None)
    backend = RotatedPages(Recorder())
    with pytest.raises(ValueError):  # the call reaches the inner backend as it is (a K/V pool, no V)
        backend.forward(latent)
    assert seen[-1] is latent


def test_only_quantized_storage_is_wrapped_and_the_backend_keeps_its_name() -> None:
    platform = Platform(on_cpu=True, metal=False, numba=True, blas="test")
    plain = select_attention("mlx", mx.float32, platform, (D,))
    rotated = select_attention("mlx", mx.float32, platform, (D,), kv_storage="int8")
    assert not isinstance(plain, RotatedPages) and isinstance(rotated, RotatedPages)
    assert rotated.name == plain.name == "mlx" and "Hadamard" in rotated.description
