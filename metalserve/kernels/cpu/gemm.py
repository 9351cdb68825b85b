"""MKL's single-precision GEMM, callable from numba kernels, for the CPU path's long prefill chunks.

A prefill chunk of hundreds of rows is a real matrix product: the packed-codes kernel's four-by-four
register tile streams every input row past each four output rows and reached a fraction of what a tuned
GEMM does. MKL is already loaded (metalserve/blas.py, for MLX's CPU backend); its `cblas_sgemm` is taken
here as a ctypes function and handed to the kernels as an argument (a global ctypes function would make
numba refuse to cache them). Each call runs on the calling numba thread alone: the kernels split their
work over numba's threads, and MKL's own team on top would oversubscribe the cores.

Where MKL is absent (Linux on ARM, `METALSERVE_BLAS=none`), `Gemm.usable` is False and the kernels keep
their own loops; the stand-in functions are never called.

`--cpu-bf16-prefill` (`set_bf16_mode`): the prefill projections round their inputs (activations and the
tile's dequantized weights) to bfloat16 and take MKL's `cblas_gemm_bf16bf16f32`, which accumulates in
fp32. Where the CPU has AMX, MKL runs it on the tiles: a 512 x 896 x 4864 product on one thread took
5.0 ms against sgemm's 24.5 (AVX-512 BF16 alone: 12.6 ms). Not exact: each input keeps 8 bits of mantissa.
It is called in its pack-once form: the chunk is packed into MKL's layout once per projection
(`pack_bf16`), then every tile multiplies against the pack (`gemm_bf16_packed`); called whole, each tile's
call packed the chunk again (a 512 x 4864 chunk against a 256-row tile: 2.3 ms whole, 1.6 ms on the pack).
"""

from __future__ import annotations

import ctypes
import os
from functools import cache
from typing import Any, NamedTuple

import numba
import numpy as np
from llvmlite import binding

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
_PACK_SIZE = ctypes.CFUNCTYPE(ctypes.c_size_t, *(ctypes.c_int,) * 4)  # identifier, m, n, k
# layout, identifier, trans, m, n, k, source, its leading dimension, destination
_PACK = ctypes.CFUNCTYPE(None, *(ctypes.c_int,) * 6, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)
ROW_MAJOR, NO_TRANS, TRANS, PACKED, A_MATRIX = 101, 111, 112, 151, 161
F32 = 4  # bytes


BF16_MODES = ("auto", "on", "off")
# How rank 0 hands the resolved mode to the local ranks it starts (as int8_dot.RANKS_ENV).
BF16_RANKS_ENV = "METALSERVE_RANKS_CPU_BF16_PREFILL"
_bf16_state = {"on": False}


class Gemm(NamedTuple):
    """`sgemm`: cblas_sgemm; `set_threads`: MKL_Set_Num_Threads_Local (returns the previous setting);
    `pack_size`, `pack`, `compute_bf16`: cblas_gemm_bf16bf16f32 in its pack-once form (_pack_get_size,
    _pack, _compute), which the kernels call instead of `sgemm` where `bf16`."""

    sgemm: Any
    set_threads: Any
    usable: bool
    bf16: bool
    pack_size: Any
    pack: Any
    compute_bf16: Any


def has_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX); MKL emulates it elsewhere."""
    features = binding.get_host_cpu_features()
    return bool(features.get("avx512bf16")) or bool(features.get("amx-bf16"))


def set_bf16_mode(mode: str) -> bool:
    """`--cpu-bf16-prefill`: `on`, `off`, or `auto` (on where the CPU has BF16 or AMX). Returns the result.
    Read by `host_gemm`, so set it before loading models."""
    if mode not in BF16_MODES:
        raise ValueError(f"--cpu-bf16-prefill takes one of {', '.join(BF16_MODES)}, not {mode!r}")
    _bf16_state["on"] = mode == "on" or (mode == "auto" and has_bf16())
    os.environ[BF16_RANKS_ENV] = "on" if _bf16_state["on"] else "off"
    host_gemm.cache_clear()
    return _bf16_state["on"]


def _never_sgemm(*args: object) -> None:
    raise RuntimeError("the stand-in sgemm was called although Gemm.usable is False")


def _never_threads(n: int) -> int:
    raise RuntimeError("the stand-in thread setter was called although Gemm.usable is False")


def _never_size(*args: object) -> int:
    raise RuntimeError("the stand-in pack size was called although Gemm.usable is False")


def _never_pack(*args: object) -> None:
    raise RuntimeError("the stand-in pack was called although Gemm.usable is False")


@cache
def host_gemm() -> Gemm:
    """MKL's GEMM if the mkl package's library loads, else unusable stand-ins (kept alive by the cache)."""
    from metalserve.blas import ENV_VAR, find_mkl

    path = None if os.environ.get(ENV_VAR, "").strip().lower() == "none" else find_mkl()
    if path is not None:
        try:
            lib = ctypes.CDLL(str(path))
            sgemm, threads = _SGEMM(("cblas_sgemm", lib)), _SET_THREADS(("MKL_Set_Num_Threads_Local", lib))
            size = _PACK_SIZE(("cblas_gemm_bf16bf16f32_pack_get_size", lib))
            pack, compute = _PACK(("cblas_gemm_bf16bf16f32_pack", lib)), _SGEMM(("cblas_gemm_bf16bf16f32_compute", lib))
            return Gemm(sgemm, threads, True, _bf16_state["on"], size, pack, compute)
        except (OSError, AttributeError):
            pass
    never = _SGEMM(_never_sgemm)
    return Gemm(never, _SET_THREADS(_never_threads), False, False, _PACK_SIZE(_never_size), _PACK(_never_pack), never)


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


@numba.njit(fastmath=True, cache=True, nogil=True)
def pack_bf16(gemm, m, n, k, a, lda):  # noqa: ANN001, ANN202
    """bfloat16 `a` `[m, k]` (a raw address, leading dimension in elements) in MKL's packed form, once for
    every gemm_bf16_packed of it against up to `n` rows: `[bytes]` uint8. On this thread alone."""
    packed = np.empty(gemm.pack_size(A_MATRIX, m, n, k), np.uint8)
    previous = gemm.set_threads(1)
    gemm.pack(ROW_MAJOR, A_MATRIX, NO_TRANS, m, n, k, a, lda, packed.ctypes.data)
    gemm.set_threads(previous)
    return packed


@numba.njit(fastmath=True, cache=True, nogil=True)
def gemm_bf16_packed(gemm, m, n, k, packed, b, ldb, c, ldc):  # noqa: ANN001, ANN202
    """`c = a @ b.T` for bfloat16 `a` `[m, k]`, packed by pack_bf16 (`packed`: its address; `n` at most
    the pack's), and `b` `[n, k]` (the raw address of uint16 rows, leading dimension in elements); fp32
    `c`. On this thread alone."""
    if m == 0 or n == 0:
        return
    previous = gemm.set_threads(1)
    one, zero = np.float32(1.0), np.float32(0.0)
    gemm.compute_bf16(ROW_MAJOR, PACKED, TRANS, m, n, k, one, packed, k, b, ldb, zero, c, ldc)
    gemm.set_threads(previous)


@numba.njit(fastmath=True, cache=True, nogil=True)
def to_bf16(x, out):  # noqa: ANN001, ANN202
    """out[...] = x rounded to the nearest bfloat16 (ties to even), as the top halves of float32 bits;
    `x` float32 and `out` uint16 of one shape, both C-contiguous. Finite inputs only."""
    bits = x.reshape(-1).view(np.uint32)
    flat = out.reshape(-1)
    for i in range(bits.shape[0]):
        b = bits[i]
        flat[i] = np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
