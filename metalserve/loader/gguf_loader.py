"""Load a GGUF file: checks first, then tensors, config and tokenizer.

Files whose tensors are all of the types `mx.load` reads exactly (F32, F16, Q4_0, Q4_1, Q8_0) go through
it, so their quantized layers stay in MLX's affine layout (kept quantized on Metal). Files with any other
type (K-quants, Q5_0/Q5_1, BF16) are read by gguf_reader.py: Q4_K into the affine layout too, the rest
dequantized to dense arrays (gguf_dequant.py says why).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from metalserve.kernels.cpu.packed_codes import PackedCodes
from metalserve.loader.errors import ModelLoadError
from metalserve.loader.gguf_config import check_architecture, config_from_gguf
from metalserve.loader.gguf_header import AFFINE_TYPES, DEQUANTIZED_TYPES, GGUFFormatError, GGUFHeader, read_header
from metalserve.loader.gguf_reader import read_gguf
from metalserve.loader.gguf_tokenizer import tokenizer_from_gguf
from metalserve.loader.gguf_weights import (
    MLX_NATIVE_TYPES,
    ROPE_FACTOR_TENSORS,
    check_tensor_types,
    convert_weights,
    map_name,
)
from metalserve.loader.loaded import RawModel

if TYPE_CHECKING:
    from metalserve.loader.gguf_codes import FileRows

_LAYER_SUFFIXES = ("attn_q.weight", "attn_qkv.weight")


def _check_header(path: Path) -> GGUFHeader:
    try:
        header = read_header(path)
    except GGUFFormatError as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}.") from exc
    try:
        check_architecture(header.architecture)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    check_tensor_types(header.tensor_types)
    return header


def _stored_as(header: GGUFHeader) -> str:
    """Name the file by its layers' type: the embedding is often stored differently."""
    types = header.tensor_types
    layer_types = Counter(t for n, t in types.items() if n.startswith("blk.") and n.endswith(_LAYER_SUFFIXES))
    return layer_types.most_common(1)[0][0] if layer_types else "F32"


def _read_native(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    try:
        tensors, metadata = mx.load(str(path), return_metadata=True)
    except RuntimeError as exc:
        raise ModelLoadError(f"MLX could not read the GGUF file {path}: {exc}") from exc
    assert isinstance(tensors, dict) and isinstance(metadata, dict)
    return tensors, metadata


def _read_dense(path: Path, dense_dtype: mx.Dtype) -> tuple[dict[str, mx.array], dict[str, Any]]:
    from metalserve.loader.gguf_dequant import read_tensors  # imports gguf: only files that need it

    try:
        file = read_gguf(path)
    except GGUFFormatError as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}.") from exc
    return read_tensors(file, dense_dtype), file.metadata


def native_reader_suffices(header: GGUFHeader) -> bool:
    """Whether `mx.load` reads every tensor of the file exactly (else gguf_reader.py reads it)."""
    return all(kind in MLX_NATIVE_TYPES for kind in header.tensor_types.values())


def _codes_by_module(
    codes: dict[str, PackedCodes | FileRows], arch: str, n_heads: int, n_kv_heads: int
) -> dict[str, PackedCodes | FileRows]:
    """Codes by mlx-lm module path, with llama's Q/K row interleaving undone as for the weights."""
    out = {}
    for name, packed in codes.items():
        new = map_name(name, arch)
        heads = n_heads if ".self_attn.q_proj." in new else n_kv_heads if ".self_attn.k_proj." in new else 0
        if arch == "llama" and heads and isinstance(packed, PackedCodes):
            rows = packed.shape[0]
            order = np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)
            packed = packed.take_rows(order)
        out[new.removesuffix(".weight")] = packed
    return out


def load_gguf(
    path: Path, dense_dtype: mx.Dtype = mx.float32, allow_dense: bool = True, keep_codes: bool = False
) -> RawModel:
    """Read the GGUF at `path` into a RawModel (weights renamed and converted for mlx-lm).

    `dense_dtype`: what tensors of types MLX cannot keep quantized are dequantized to. `allow_dense`
    False (weights="quantized") refuses such a file instead of silently dequantizing it. `keep_codes`
    (the CPU fast path): every quantized matrix is kept in its packed codes instead (RawModel.codes)."""
    header = _check_header(path)
    stored_as = _stored_as(header)
    codes: dict[str, PackedCodes | FileRows] = {}
    if keep_codes:
        from metalserve.loader.gguf_codes import read_with_codes

        try:
            file = read_gguf(path)
        except GGUFFormatError as exc:
            raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}.") from exc
        tensors, codes = read_with_codes(file)
        metadata = file.metadata
    elif native_reader_suffices(header):
        tensors, metadata = _read_native(path)
    else:
        dense = sorted({k for k in header.tensor_types.values() if k in DEQUANTIZED_TYPES and k not in AFFINE_TYPES})
        if dense and not allow_dense:
            raise ModelLoadError(
                f"{path} stores {', '.join(dense)} tensors, which cannot stay quantized (MLX has no layout for "
                f"them; {', '.join(MLX_NATIVE_TYPES[2:] + AFFINE_TYPES)} can); use weights 'auto' or 'dequantize'."
            )
        tensors, metadata = _read_dense(path, dense_dtype)
        if dense:
            read = f"{', '.join(dense)} dequantized at read"
            stored_as = f"{stored_as}, {read}" if dense == [stored_as] else f"{stored_as} ({read})"
    factors = {name: tensors.pop(name).astype(mx.float32).tolist() for name in ROPE_FACTOR_TENSORS if name in tensors}
    tensor_names = {n.removesuffix(".scales").removesuffix(".biases") for n in tensors}
    config = config_from_gguf(metadata, tensor_names, factors)  # type: ignore[arg-type]
    arch = str(metadata["general.architecture"])
    heads = (config["num_attention_heads"], config["num_key_value_heads"])
    weights = convert_weights(tensors, *heads, arch)
    tokenizer = tokenizer_from_gguf(metadata, arch)
    template = metadata.get("tokenizer.chat_template")
    raw = RawModel(config, weights, tokenizer, template if isinstance(template, str) else None, stored_as)
    raw.codes = _codes_by_module(codes, arch, *heads)
    return raw
