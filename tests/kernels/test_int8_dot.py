"""Decode rows dotted in integers (kernels/cpu/int8_dot.py): within int8 error of float64 where it applies,
the float kernel's exact result where it does not, and VNNI's instruction where the CPU has it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest

from metalserve.kernels.cpu import int8_dot
from metalserve.kernels.cpu.packed_linear import packed_linear, segments_of
from tests.kernels.test_packed_codes import random_codes


@pytest.mark.parametrize("tokens", [1, 3])
def test_int8_rows_are_within_int8_error_and_other_layouts_stay_exact(tokens: int) -> None:
    """Layer 0 takes the int8 dot (4 bits, groups of 32, a 32-byte tail at 576 columns; 8 bits); layer 1 has a
    6-bit part and groups of 16, which keep the float kernel and its exactness."""
    layer0 = [random_codes(37, 576, 4, 32, 1), random_codes(9, 576, 8, 32, 2)]
    layer1 = [random_codes(37, 576, 6, 16, 3), random_codes(9, 576, 4, 16, 4)]
    rng = np.random.default_rng(tokens)
    bias = rng.standard_normal((2, 46)).astype(np.float32)
    x = rng.standard_normal((tokens, 576)).astype(np.float32)
    exact = segments_of([[p for p, _ in layer0], [p for p, _ in layer1]], bias, int8=False)
    fast = exact._replace(int8=True)
    for layer, parts in enumerate((layer0, layer1)):
        dense = np.concatenate([d for _, d in parts]).astype(np.float64)
        want = x.astype(np.float64) @ dense.T + bias[layer]
        np.testing.assert_allclose(packed_linear(x, exact, layer), want, rtol=1e-4, atol=1e-4)
        got = packed_linear(x, fast, layer)
        if layer == 0:
            error = np.abs(got - want).max() / np.abs(want).max()
            assert 0 < error < 2e-2  # int8's error: not the float kernel's answer, and close to it
        else:
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def _int8_reference(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, biases: np.ndarray) -> np.ndarray:
    """What the int8 path computes, in float64: `x` quantized as quantize_row does (per block of 32, scale
    amax / 127, round half to even), dotted with the integer codes and scaled per group."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    d = np.where(amax > 0, amax / np.float32(127.0), np.float32(1.0)).astype(np.float32)
    xq = (np.round(blocks / d) * d).reshape(x.shape).astype(np.float64)  # the dequantized int8 input
    group = x.shape[1] // scales.shape[1]
    w = np.repeat(scales.astype(np.float64), group, 1) * codes + np.repeat(biases.astype(np.float64), group, 1)
    return xq @ w.T


@pytest.mark.parametrize(
    ("columns", "bits", "group"),
    [
        (896, 5, 32),  # the coder 0.5B's Q5_0: bit planes of 112 columns, windows that straddle two
        (896, 6, 16),  # Q6_K: groups of 16, planes of 224
        (4864, 6, 16),
        (512, 5, 32),  # planes of 64: every window inside one
        (1536, 5, 64),  # a group spans two input blocks
        (896, 4, 64),  # 4 bits whose groups straddle the half-row (MLX's group size)
        (896, 4, 16),
    ],
)
def test_bit_plane_rows_match_the_same_quantization_in_float64(columns: int, bits: int, group: int) -> None:
    """int8_plane_rows: every code read from the right nibble and bit plane, each 16 or 32 columns' integer
    dot scaled by the right block and group (against NumPy doing the same quantization: only float32's
    rounding apart), and the step itself within int8 error of the exact weights."""
    packed, dense = random_codes(37, columns, bits, group, seed=columns + bits)
    assert int8_dot.plane_rows_apply(bits, columns, group)
    x = np.random.default_rng(bits).standard_normal((2, columns)).astype(np.float32)
    got = packed_linear(x, segments_of([[packed]], int8=True))
    same_quantization = _int8_reference(x, packed.unpacked(), packed.scales, packed.biases)
    np.testing.assert_allclose(got, same_quantization, rtol=1e-4, atol=1e-4 * np.abs(same_quantization).max())
    exact = x.astype(np.float64) @ dense.astype(np.float64).T
    assert 0 < np.abs(got - exact).max() / np.abs(exact).max() < 2e-2


def test_layouts_the_windows_cannot_read_keep_the_float_kernel() -> None:
    """Bit planes narrower than a window (5 bits over 256 columns: planes of 32), half-rows that are not
    whole windows (576 columns), groups of 48: the exact float kernel, not a wrong integer one."""
    assert not int8_dot.plane_rows_apply(5, 256, 32)
    assert not int8_dot.plane_rows_apply(5, 576, 32) and not int8_dot.plane_rows_apply(6, 576, 16)
    assert not int8_dot.plane_rows_apply(4, 1536, 48) and not int8_dot.plane_rows_apply(8, 896, 32)
    packed, dense = random_codes(9, 256, 5, 32, seed=5)
    x = np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32)
    want = x.astype(np.float64) @ dense.astype(np.float64).T
    np.testing.assert_allclose(packed_linear(x, segments_of([[packed]], int8=True)), want, rtol=1e-4, atol=1e-4)


def test_the_mode_is_auto_on_off_and_read_when_segments_are_built() -> None:
    before = int8_dot.enabled()
    try:
        assert int8_dot.set_mode("on") and segments_of([[random_codes(4, 64, 4, 32)[0]]]).int8
        assert os.environ[int8_dot.RANKS_ENV] == "on"  # what the local ranks rank 0 starts will read
        assert not int8_dot.set_mode("off") and not segments_of([[random_codes(4, 64, 4, 32)[0]]]).int8
        assert int8_dot.set_mode("auto") == int8_dot.has_vnni()
        with pytest.raises(ValueError, match="one of auto, on, off"):
            int8_dot.set_mode("fast")
    finally:
        int8_dot.set_mode("on" if before else "off")


def test_vnni_is_emitted_where_the_cpu_has_it() -> None:
    if not int8_dot.has_vnni():
        pytest.skip("this CPU has no AVX-512 VNNI: the portable vector form is used (tested below)")

    @numba.njit(cache=False)
    def chunk(codes, xq):  # type: ignore[no-untyped-def]
        return int8_dot._dot64(np.int64(codes.ctypes.data), np.int64(xq.ctypes.data), int8_dot.BYTE)

    rng = np.random.default_rng(0)
    codes, xq = rng.integers(0, 256, 64).astype(np.uint8), rng.integers(-127, 128, 64).astype(np.int8)
    want = (codes.astype(np.int64) * xq).reshape(2, 32).sum(1)
    assert list(chunk(codes, xq)) == list(want)
    assert "vpdpbusd" in "".join(chunk.inspect_asm().values())


def test_half_bits_widen_to_float32_exactly() -> None:
    """Packed codes' float16 scales, read as their uint16 bits: every class of value (subnormal, signed
    zero, the largest, infinity) as NumPy widens it, in a loop LLVM vectorizes to F16C's conversion."""

    @numba.njit(cache=False, fastmath=True)
    def widen(bits, weights, out):  # type: ignore[no-untyped-def]
        for i in range(bits.shape[0]):
            out[i] = int8_dot.half_to_float(bits[i]) * weights[i]

    special = np.array([1.5, -2.25, 6.1e-5, 3e-7, -6e-8, 65504, 0.0, -0.0, np.inf, -np.inf], np.float16)
    values = np.concatenate([special, np.random.default_rng(0).standard_normal(246).astype(np.float16)])
    out = np.empty(values.size, np.float32)
    widen(values.view(np.uint16), np.ones(values.size, np.float32), out)
    np.testing.assert_array_equal(out, values.astype(np.float32))
    assert np.signbit(out[7]) and not np.signbit(out[6])
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists() and " f16c" in cpuinfo.read_text():  # x86-64 with F16C (arm64 converts natively)
        assert "vcvtph2ps" in "".join(widen.inspect_asm().values())


PORTABLE = """
import numpy as np
from metalserve.kernels.cpu import int8_dot
int8_dot.has_vnni = lambda: False  # before anything compiles: the portable vector IR
from metalserve.kernels.cpu.packed_linear import packed_linear, segments_of
from tests.kernels.test_packed_codes import random_codes
parts = [random_codes(37, 576, 4, 32, 1), random_codes(9, 576, 8, 32, 2)]
x = np.random.default_rng(0).standard_normal((1, 576)).astype(np.float32)
want = x.astype(np.float64) @ np.concatenate([d for _, d in parts]).astype(np.float64).T
got = packed_linear(x, segments_of([[p for p, _ in parts]], int8=True))
error = np.abs(got - want).max() / np.abs(want).max()
assert 0 < error < 2e-2, error
planes, dense = random_codes(11, 896, 5, 32, 3)  # the bit-plane windows too
x = np.random.default_rng(1).standard_normal((1, 896)).astype(np.float32)
want = x.astype(np.float64) @ dense.astype(np.float64).T
got = packed_linear(x, segments_of([[planes]], int8=True))
plane_error = np.abs(got - want).max() / np.abs(want).max()
assert 0 < plane_error < 2e-2, plane_error
x = np.random.default_rng(2).standard_normal((8, 896)).astype(np.float32)  # eight rows: int8_windows.py
want = x.astype(np.float64) @ dense.astype(np.float64).T
got = packed_linear(x, segments_of([[planes]], int8=True))
rows_error = np.abs(got - want).max() / np.abs(want).max()
assert 0 < rows_error < 2e-2, rows_error
print("portable ok", error, plane_error, rows_error)
"""


def test_the_portable_form_where_the_cpu_has_no_vnni(tmp_path: Path) -> None:
    """The IR without VNNI's intrinsic, compiled in a process of its own (its own numba cache, so the VNNI
    build cached here is not loaded): the same answers. (On this CPU LLVM may still pick VNNI instructions
    for the portable form's multiply-and-sum; it ran 1.4-1.9x slower than the intrinsic here.)"""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(Path(__file__).parents[2])}
    done = subprocess.run([sys.executable, "-c", PORTABLE], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "portable ok" in done.stdout, done.stderr[-3000:]
