"""MKL's single-precision GEMM, callable from numba kernels, for the CPU path's long prefill chunks.

A prefill chunk of hundreds of rows is a real matrix product: the packed-codes kernel's four-by-four
register tile streams every input row past each four output rows and reached a fraction of what a tuned
GEMM does. MKL is already loaded (metalserve/blas.py, for MLX's CPU backend); its `cblas_sgemm` is taken
here as a ctypes function and handed to the kernels as an argument (a global ctypes function would make
numba refuse to cache them). Each call runs on the calling numba thread alone: the kernels split their
work over numba's threads, and MKL's own team on top would oversubscribe the cores.

Where MKL is absent (Linux on ARM, `METALSERVE_BLAS=none`), `Gemm.usable` is False and the kernels keep
their own loops; the stand-in functions are never called.
"""

from __future__ import annotations

import ctypes
import os
from functools import cache
from typing import Any, NamedTuple

import numba
import numpy as np

_SGEMM = ctypes.CFUNCTYPE(
    None,
    *(ctypes.c_int,) * 6,  # layout, trans a, trans b, m, n, k
    ctypes.c_float,
    ctypes.c_void_p,
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_int,
    ctypes.c_float,
    ctypes.c_void_p,
    ctypes.c_int,
)
_SET_THREADS = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)
ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112
F32 = 4  # bytes


class Gemm(NamedTuple):
    """`sgemm`: cblas_sgemm; `set_threads`: MKL_Set_Num_Threads_Local (returns the previous setting)."""

    sgemm: Any
    set_threads: Any
    usable: bool


def _never_sgemm(*args: object) -> None:
    raise RuntimeError("the stand-in sgemm was called although Gemm.usable is False")


def _never_threads(n: int) -> int:
    raise RuntimeError("the stand-in thread setter was called although Gemm.usable is False")


@cache
def host_gemm() -> Gemm:
    """MKL's GEMM if the mkl package's library loads, else unusable stand-ins (kept alive by the cache)."""
    from metalserve.blas import ENV_VAR, find_mkl

    path = None if os.environ.get(ENV_VAR, "").strip().lower() == "none" else find_mkl()
    if path is not None:
        try:
            lib = ctypes.CDLL(str(path))
            return Gemm(_SGEMM(("cblas_sgemm", lib)), _SET_THREADS(("MKL_Set_Num_Threads_Local", lib)), True)
        except (OSError, AttributeError):
            pass
    return Gemm(_SGEMM(_never_sgemm), _SET_THREADS(_never_threads), False)


@numba.njit(fastmath=True, cache=True, nogil=True)
def sgemm(gemm, trans_b, m, n, k, a, lda, b, ldb, c, ldc):  # noqa: ANN001, ANN202  (numba infers the types)
    """`c = a @ op(b)` on raw addresses (row-major, leading dimensions in elements): op(b) is `b.T`
    (`b` `[n, k]`) when `trans_b`, else `b` (`[k, n]`). On this thread alone."""
    if m == 0 or n == 0:
        return
    previous = gemm.set_threads(1)
    gemm.sgemm(
        ROW_MAJOR,
        NO_TRANS,
        TRANS if trans_b else NO_TRANS,
        m,
        n,
        k,
        np.float32(1.0),
        a,
        lda,
        b,
        ldb,
        np.float32(0.0),
        c,
        ldc,
    )
    gemm.set_threads(previous)
