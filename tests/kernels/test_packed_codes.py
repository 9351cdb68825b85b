"""Packed codes (4/5/6/8 bits, groups of 16 to 128) and the numba kernels that read them in place."""

from __future__ import annotations

import numpy as np
import pytest

from metalserve.kernels.cpu.packed_codes import PackedCodes, row_bytes, stored_bits
from metalserve.kernels.cpu.packed_linear import FEW_ROWS, gather_rows, packed_linear, segments_of


def random_codes(rows: int, columns: int, bits: int, group: int, seed: int = 0) -> tuple[PackedCodes, np.ndarray]:
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 2**bits, (rows, columns)).astype(np.uint8)
    # float16 values, which packing keeps exactly (it stores scales and offsets as float16)
    scales = rng.uniform(0.01, 0.1, (rows, columns // group)).astype(np.float16).astype(np.float32)
    biases = rng.uniform(-1, 1, (rows, columns // group)).astype(np.float16).astype(np.float32)
    dense = np.repeat(scales, group, axis=1) * q + np.repeat(biases, group, axis=1)
    return PackedCodes.pack(q, scales, biases, bits), dense


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("group", [16, 32, 64])
def test_packing_keeps_every_code_in_the_bytes_the_width_takes(bits: int, group: int) -> None:
    packed, dense = random_codes(5, 128, bits, group, seed=bits)
    assert packed.bits == stored_bits(bits) and packed.group_size == group
    assert packed.codes.shape == (5, row_bytes(packed.bits, 128))
    # 4 bits: 64 bytes for 128 weights; 5: 80; 6: 96; 8: 128.
    assert packed.codes.shape[1] == {4: 64, 5: 80, 6: 96, 8: 128}[packed.bits]
    np.testing.assert_allclose(packed.dense(), dense, rtol=1e-6, atol=1e-6)


def test_scales_and_offsets_are_kept_as_float16_to_within_its_rounding() -> None:
    rng = np.random.default_rng(3)
    q = rng.integers(0, 16, (4, 64)).astype(np.uint8)
    # A K-quant's scales: a float16 times a 6-bit integer, which float16 may not hold exactly.
    d = rng.uniform(1e-4, 1e-2, (4, 1)).astype(np.float16).astype(np.float32)
    scales = d * rng.integers(1, 64, (4, 2)).astype(np.float32)
    biases = -d * rng.integers(0, 64, (4, 2)).astype(np.float32)
    packed = PackedCodes.pack(q, scales, biases, 4)
    assert packed.scales.dtype == packed.biases.dtype == np.float16
    assert packed.nbytes == 4 * 32 + 2 * (4 * 2 * 2)  # half a byte a code, two bytes a scale and an offset
    np.testing.assert_allclose(packed.scales.astype(np.float32), scales, rtol=2.0**-11)
    np.testing.assert_allclose(packed.biases.astype(np.float32), biases, rtol=2.0**-11)
    with pytest.raises(ValueError, match="float16's range"):
        PackedCodes.pack(q, scales * 1e7, biases, 4)


def test_rows_reorder_and_concatenate_with_their_scales() -> None:
    a, dense_a = random_codes(8, 64, 4, 32, seed=1)
    b, dense_b = random_codes(4, 64, 4, 32, seed=2)
    order = np.array([1, 0, 3, 2, 5, 4, 7, 6])
    np.testing.assert_array_equal(a.take_rows(order).dense(), a.dense()[order])
    joined = PackedCodes.concatenate([a, b])
    assert joined is not None
    np.testing.assert_allclose(joined.dense(), np.concatenate([dense_a, dense_b]), rtol=1e-6)
    assert PackedCodes.concatenate([a, random_codes(4, 64, 6, 16)[0]]) is None  # packed differently


def test_packed_codes_check_their_shapes() -> None:
    packed, _ = random_codes(4, 64, 4, 32)
    with pytest.raises(ValueError, match="uint8"):
        PackedCodes(packed.codes[:, 1:], packed.scales, packed.biases, 4, 64)
    with pytest.raises(ValueError, match="do not group"):
        PackedCodes(packed.codes, packed.scales[:, :1].repeat(3, axis=1), packed.biases, 4, 64)
    with pytest.raises(ValueError, match="bits"):
        PackedCodes(packed.codes, packed.scales, packed.biases, 3, 64)
    with pytest.raises(ValueError, match="cannot be packed"):
        stored_bits(9)


@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 5, 7, 9])
def test_a_projection_of_mixed_blocks_and_layers_matches_a_dense_matmul(tokens: int) -> None:
    """A Q4_K_M-like fused q/k/v: 4-bit q and k, a 6-bit v (groups of 16), in two layers packed differently;
    block sizes that are not multiples of four rows."""
    layer0 = [random_codes(37, 96, 4, 32, 1), random_codes(6, 96, 4, 32, 2), random_codes(6, 96, 6, 16, 3)]
    layer1 = [random_codes(37, 96, 8, 32, 4), random_codes(6, 96, 5, 32, 5), random_codes(6, 96, 4, 32, 6)]
    rng = np.random.default_rng(tokens)
    bias = rng.standard_normal((2, 49)).astype(np.float32)
    segments = segments_of([[p for p, _ in layer0], [p for p, _ in layer1]], bias)
    x = rng.standard_normal((tokens, 96)).astype(np.float32)
    for layer, parts in enumerate((layer0, layer1)):
        dense = np.concatenate([d for _, d in parts]).astype(np.float64)
        want = x.astype(np.float64) @ dense.T + bias[layer]
        np.testing.assert_allclose(packed_linear(x, segments, layer), want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"\[T, 96\] float32"):
        packed_linear(x[:, :64], segments)


@pytest.mark.parametrize("count", [4, FEW_ROWS + 1])  # a decode step's few rows (serial), a prefill's (parallel)
def test_embedding_rows_unpack_from_the_codes(count: int) -> None:
    packed, dense = random_codes(50, 64, 8, 32)
    ids = np.resize(np.array([3, 0, 49, 3]), count)
    np.testing.assert_allclose(gather_rows(packed, ids), dense[ids], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="row ids"):
        gather_rows(packed, np.array([50]))
