"""GGUF tensors of any supported ggml type as MLX arrays (for files `mx.load` cannot read exactly).

Q4_K, Q5_K, Q5_0 and Q5_1 matrices map exactly onto MLX's 4/5-bit affine layout (gguf_affine.py) and
stay packed, so Metal keeps them quantized and the CPU host path reads their codes, as for Q4_0/Q4_1.
MLX has no groups of 16 for Q2_K, Q3_K and Q6_K, so those become dense: fp32, or fp16 when asked (on
Metal, half the memory). BF16/F16/F32 stay as stored. The NumPy decoders release the GIL, so tensors are
decoded on a thread pool.
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import gguf
import mlx.core as mx
import numpy as np

from metalserve.loader.gguf_affine import AFFINE
from metalserve.loader.gguf_header import AFFINE_TYPES
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


def affine_numpy(raw: np.ndarray, kind: str, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_K/Q5_K/Q5_0/Q5_1 tensor's bytes as MLX's affine layout: codes packed in uint32, fp32 scales
    and biases (one per 32 values), row chunk by row chunk."""
    size, values, bits, repack = AFFINE[kind]
    rows = raw.reshape(-1, shape[-1] // values * size)
    n, groups = rows.shape[0], shape[-1] // 32
    packed = np.empty((n, shape[-1] * bits // 32), dtype=np.uint32)
    scales, biases = np.empty((n, groups), dtype=np.float32), np.empty((n, groups), dtype=np.float32)
    step = max(1, _CHUNK_VALUES // shape[-1])
    for start in range(0, n, step):
        p, s, b = repack(rows[start : start + step].reshape(-1, size))
        packed[start : start + step] = p.reshape(-1, packed.shape[1])
        scales[start : start + step] = s.reshape(-1, groups)
        biases[start : start + step] = b.reshape(-1, groups)
    lead = shape[:-1]
    return packed.reshape(*lead, -1), scales.reshape(*lead, -1), biases.reshape(*lead, -1)


def keeps_affine(info: TensorInfo) -> bool:
    """Q4_K/Q5_K/Q5_0/Q5_1 matrices (and stacked experts) map exactly onto MLX's affine layout: kept packed."""
    return info.kind in AFFINE_TYPES and len(info.shape) >= 2 and info.name.endswith(".weight")


def _decode(file: GGUFFile, info: TensorInfo, half: bool) -> dict[str, np.ndarray]:
    """The tensor as NumPy by name: dense types as stored (BF16 as its uint16 bits), affine ones as
    `.weight`/`.scales`/`.biases` in MLX's affine layout, other quantized ones dequantized; fp16 if `half`."""
    raw = file.data[info.start : info.start + info.nbytes]
    if info.kind in _VIEWS:
        return {info.name: raw.view(_VIEWS[info.kind]).reshape(info.shape)}
    dtype = np.float16 if half else np.float32
    if keeps_affine(info):
        packed, scales, biases = affine_numpy(raw, info.kind, info.shape)
        base = info.name.removesuffix(".weight")
        scales, biases = scales.astype(dtype, copy=False), biases.astype(dtype, copy=False)
        return {info.name: packed, f"{base}.scales": scales, f"{base}.biases": biases}
    return {info.name: dequantize_numpy(raw, info.kind, info.shape).astype(dtype, copy=False)}


def read_tensors(file: GGUFFile, dense_dtype: mx.Dtype) -> dict[str, mx.array]:
    """Every tensor of the file; `dense_dtype` (fp32 or fp16) for dequantized values and affine scales.
    Decoding runs on up to eight threads (largest tensors first, to balance
    them); MLX arrays are made on this thread, in order. At most two tensors per thread are decoded
    ahead of that, so the fp32 NumPy copies in memory stay a few tensors, not the model."""
    infos = sorted(file.tensors.values(), key=lambda t: -t.nbytes)
    workers = max(1, min(_MAX_THREADS, os.cpu_count() or 1))
    half = dense_dtype == mx.float16
    out: dict[str, mx.array] = {}
    pending: deque[tuple[TensorInfo, Future[dict[str, np.ndarray]]]] = deque()

    def collect() -> None:
        info, future = pending.popleft()
        for name, values in future.result().items():
            out[name] = mx.array(values).view(mx.bfloat16) if info.kind == "BF16" else mx.array(values)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        for info in infos:
            if len(pending) >= 2 * workers:
                collect()
            pending.append((info, pool.submit(_decode, file, info, half)))
        while pending:
            collect()
    return out
