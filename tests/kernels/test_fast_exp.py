"""The CPU kernels' exp (kernels/cpu/fast_exp.py): float32-close to libm's down to e^-64, and exactly 0 below,
never a denormal (a product with a denormal costs x86 a microcode assist)."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from metalserve.kernels.cpu.fast_exp import FLUSH_BELOW, exp_parts
from metalserve.platform import current_platform

pytestmark = pytest.mark.skipif(not current_platform().numba, reason="the CPU kernels need numba")


@numba.njit(cache=False)
def _exp(v):  # noqa: ANN001, ANN202
    out = np.empty_like(v)
    bits = np.empty(v.shape, np.int32)
    for i in range(v.shape[0]):
        out[i], bits[i] = exp_parts(v[i])
    return out * bits.view(np.float32)


def test_exp_matches_libm_down_to_the_flush_and_is_zero_below() -> None:
    v = np.linspace(-100.0, 0.0, 20001, dtype=np.float32)
    got = _exp(v)
    kept = v >= FLUSH_BELOW
    want = np.exp(v[kept].astype(np.float64))
    np.testing.assert_allclose(got[kept], want, rtol=3e-7)
    assert not got[~kept].any()
    smallest_normal = np.finfo(np.float32).tiny
    assert got[kept].min() >= smallest_normal * 1e6  # far from denormal: its products with values stay normal
