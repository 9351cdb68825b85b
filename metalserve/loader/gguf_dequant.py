"""GGUF tensors (any supported ggml type) as dense MLX arrays, dequantized with the `gguf` package.

MLX has no layout for the K-quants, Q5_0/Q5_1 or GGUF's BF16 reader, so tensors read here become dense:
BF16/F16/F32 as stored, quantized ones as fp32 (fp16 when asked, as on Metal, to halve the memory).
gguf's dequantizers are vectorised NumPy that release the GIL, so tensors are decoded on a thread pool.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import gguf
import mlx.core as mx
import numpy as np

from metalserve.loader.gguf_kquants import FAST
from metalserve.loader.gguf_reader import GGUFFile, TensorInfo

_MAX_THREADS = 8
_CHUNK_VALUES = 1 << 16  # values dequantized per call: 256 KiB of fp32, cache-sized
_VIEWS = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def _dequantize_rows(rows: np.ndarray, kind: str, qtype: gguf.GGMLQuantizationType, out: np.ndarray) -> None:
    if kind in FAST:
        size, fast = FAST[kind]
        fast(rows.reshape(-1, size), out.reshape(-1, 256))
    else:
        out[...] = gguf.quants.dequantize(rows, qtype)


def dequantize_numpy(raw: np.ndarray, kind: str, shape: tuple[int, ...]) -> np.ndarray:
    """The fp32 values of a quantized tensor's bytes (`raw`: uint8): gguf's own dequantizer, or for
    Q4_K/Q5_K/Q6_K a faster one with the same values (gguf_kquants.py).

    Fed a few rows at a time, the temporaries stay in cache (bench/gguf_dequant.py measures both)."""
    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows = raw.reshape(-1, shape[-1] // block * size)
    out = np.empty((rows.shape[0], shape[-1]), dtype=np.float32)
    step = max(1, _CHUNK_VALUES // shape[-1])
    for start in range(0, rows.shape[0], step):
        _dequantize_rows(rows[start : start + step], kind, qtype, out[start : start + step])
    return out.reshape(shape)


def _decode(file: GGUFFile, info: TensorInfo, half: bool) -> np.ndarray:
    """The tensor as NumPy: dense types as stored (BF16 as its uint16 bits), quantized ones as fp32/fp16."""
    raw = file.data[info.start : info.start + info.nbytes]
    if info.kind in _VIEWS:
        return raw.view(_VIEWS[info.kind]).reshape(info.shape)
    values = dequantize_numpy(raw, info.kind, info.shape)
    return values.astype(np.float16) if half else values


def _to_mlx(values: np.ndarray, kind: str) -> mx.array:
    array = mx.array(values)
    return array.view(mx.bfloat16) if kind == "BF16" else array  # numpy has no bfloat16: carry the bits


def tensor_array(file: GGUFFile, info: TensorInfo, dense_dtype: mx.Dtype) -> mx.array:
    """One tensor as an MLX array: dense types as stored, quantized ones dequantized to `dense_dtype`."""
    array = _to_mlx(_decode(file, info, dense_dtype == mx.float16), info.kind)
    return array if info.kind in _VIEWS else array.astype(dense_dtype)


def read_tensors(file: GGUFFile, dense_dtype: mx.Dtype) -> dict[str, mx.array]:
    """Every tensor of the file. Decoding runs on up to eight threads (largest tensors first, to balance
    them); MLX arrays are made on this thread, each as soon as its tensor is decoded."""
    infos = sorted(file.tensors.values(), key=lambda t: -t.nbytes)
    workers = max(1, min(_MAX_THREADS, os.cpu_count() or 1))
    half = dense_dtype == mx.float16
    out: dict[str, mx.array] = {}
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for info, values in zip(infos, pool.map(lambda t: _decode(file, t, half), infos), strict=True):
            array = _to_mlx(values, info.kind)
            out[info.name] = array if info.kind in _VIEWS else array.astype(dense_dtype)
    return out
