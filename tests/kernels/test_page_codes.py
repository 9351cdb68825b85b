"""The host decoder's quantized pages (kernels/cpu/page_codes.py): float16 rounding, the Hadamard rotation
and the codes equal the NumPy reference's bit for bit; attention over the codes (decode rows read them
directly, prefill tiles decode their span) equals a float64 reference over the dequantized pages, with K
and V each in its own storage."""

from __future__ import annotations

import numpy as np
import pytest

from metalserve.executor.attention.rotation import hadamard
from metalserve.kernels.cpu import kv_quant
from metalserve.kernels.cpu.decoder_weights import PAGE_STORAGES, PagePlane, QuantPages
from metalserve.kernels.cpu.page_codes import _to_half, attend_pages, hadamard_rows, store_vector


def test_float16_rounding_equals_numpys() -> None:
    rng = np.random.default_rng(0)
    spread = rng.standard_normal(20000) * 10.0 ** rng.integers(-9, 6, 20000)
    edges = [0.0, -0.0, 65504.0, 65519.0, 65520.0, 1e-8, 6e-8, 3e-8, 2.0**-14 * (1 - 2**-11), 2.0**-24, 1.5 * 2.0**-24]
    xs = np.concatenate([spread, edges]).astype(np.float32)
    with np.errstate(over="ignore"):
        want = xs.astype(np.float16)
    got = [_to_half(x) for x in xs]
    np.testing.assert_array_equal(np.array([bits for _, bits in got], np.uint16), want.view(np.uint16))
    np.testing.assert_array_equal(np.array([value for value, _ in got], np.float32), want.astype(np.float32))


@pytest.mark.parametrize("dim", [64, 80, 128])
def test_rotation_is_the_pages_hadamard(dim: int) -> None:
    x = np.random.default_rng(1).standard_normal((5, dim)).astype(np.float32)
    got = x.copy()
    hadamard_rows(got)
    np.testing.assert_allclose(got, x @ hadamard(dim), atol=2e-6)


def _empty_plane(storage: str, heads: int, slots: int, dim: int, group: int) -> PagePlane:
    if storage == "int8":
        scales = np.zeros((heads, slots, 1), np.uint16)
        return PagePlane(np.zeros((heads, slots, dim), np.uint8), scales, scales, PAGE_STORAGES["int8"])
    scales = np.zeros((heads, slots, dim // group), np.uint16)
    return PagePlane(np.zeros((heads, slots, dim // 2), np.uint8), scales, scales.copy(), PAGE_STORAGES["q4"])


@pytest.mark.parametrize(("storage", "group"), [("int8", 32), ("q4", 32), ("q4", 16)])
def test_written_codes_equal_the_reference_quantizer(storage: str, group: int) -> None:
    x = (np.random.default_rng(2).standard_normal((50, 64)) * 3).astype(np.float32)
    x[3, :group] = 0.0  # a zero group: scale 0
    codes, scales, biases = kv_quant.quantize(x, storage, group)
    plane = _empty_plane(storage, 1, 50, 64, group)
    for slot in range(50):
        store_vector(plane.codes[0], plane.scales[0], plane.biases[0], plane.storage, slot, x[slot])
    np.testing.assert_array_equal(plane.codes[0], codes.view(np.uint8))
    np.testing.assert_array_equal(plane.scales[0], scales.reshape(50, -1).view(np.uint16))
    if biases is not None:
        np.testing.assert_array_equal(plane.biases[0], biases.view(np.uint16))


def _dequantized(plane: PagePlane, storage: str) -> np.ndarray:
    scales = plane.scales.view(np.float16)
    if storage == "int8":
        return kv_quant.dequantize(plane.codes.view(np.int8), scales, None, "int8")
    return kv_quant.dequantize(plane.codes, scales, plane.biases.view(np.float16), "q4")


def _reference(q, keys, values, tables, row_req, row_pos, block, scale, window, softcap):  # noqa: ANN001, ANN202
    out = np.zeros(q.shape, np.float64)
    group = q.shape[1] // keys.shape[0]
    for row in range(q.shape[0]):
        last = int(row_pos[row])
        first = max(0, last + 1 - window) if window else 0
        pos = np.arange(first, last + 1)
        slots = tables[row_req[row], pos // block] * block + pos % block
        for head in range(q.shape[1]):
            kv = head // group
            s = keys[kv, slots].astype(np.float64) @ q[row, head].astype(np.float64) * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            p = np.exp(s - s.max())
            out[row, head] = (p / p.sum()) @ values[kv, slots].astype(np.float64)
    return out


@pytest.mark.parametrize("k_storage", ["int8", "q4"])
@pytest.mark.parametrize("v_storage", ["int8", "q4"])
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (37, 0.0), (0, 20.0)])
def test_attention_over_codes_equals_the_dequantized_reference(
    k_storage: str, v_storage: str, window: int, softcap: float
) -> None:
    rng = np.random.default_rng(3)
    heads, hq, dim, block, group = 2, 6, 64, 16, 32
    seq_lens, q_lens = [90, 140, 33], [1, 20, 1]  # decode rows and a prefill chunk of two tiles
    tables = rng.permutation(40)[:30].reshape(3, 10).astype(np.int32)
    pages = QuantPages(*(_empty_plane(s, heads, 40 * block, dim, group) for s in (k_storage, v_storage)))
    for r, n in enumerate(seq_lens):
        for pos in range(n):
            slot = tables[r, pos // block] * block + pos % block
            for h in range(heads):
                for plane in pages:
                    vector = (rng.standard_normal(dim) * rng.uniform(0.5, 4)).astype(np.float32)
                    store_vector(plane.codes[h], plane.scales[h], plane.biases[h], plane.storage, slot, vector)
    row_req = np.repeat(np.arange(3), q_lens).astype(np.int32)
    row_pos = np.concatenate([np.arange(n - k, n) for n, k in zip(seq_lens, q_lens, strict=True)]).astype(np.int32)
    q = rng.standard_normal((len(row_req), hq, dim)).astype(np.float32)
    out = np.empty_like(q)
    scale = np.float32(dim**-0.5)
    attend_pages(q, pages, tables, row_req, row_pos, block, scale, window, np.float32(softcap), out)
    keys, values = _dequantized(pages.k, k_storage), _dequantized(pages.v, v_storage)
    want = _reference(q, keys, values, tables, row_req, row_pos, block, scale, window, softcap)
    np.testing.assert_allclose(out, want, atol=3e-5, rtol=0)
