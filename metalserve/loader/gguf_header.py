"""Read a GGUF file's architecture and tensor table without loading tensors or MLX.

Checking these first turns an unsupported file into a clear error instead of a failure deep inside
`mx.load`. gguf's own GGUFReader builds numpy views of every vocabulary string, which takes seconds.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
# ggml type ids (ggml.h) for names in error messages.
GGML_TYPE_NAMES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    6: "Q5_0",
    7: "Q5_1",
    8: "Q8_0",
    9: "Q8_1",
    10: "Q2_K",
    11: "Q3_K",
    12: "Q4_K",
    13: "Q5_K",
    14: "Q6_K",
    15: "Q8_K",
    16: "IQ2_XXS",
    17: "IQ2_XS",
    18: "IQ3_XXS",
    19: "IQ1_S",
    20: "IQ4_NL",
    21: "IQ3_S",
    22: "IQ2_S",
    23: "IQ4_XS",
    24: "I8",
    25: "I16",
    26: "I32",
    27: "I64",
    28: "F64",
    29: "IQ1_M",
    30: "BF16",
    34: "TQ1_0",
    35: "TQ2_0",
    39: "MXFP4",
}
# What metalserve reads: dense types as stored, quantized ones dequantized (gguf_dequant.py) unless
# `mx.load` keeps them in MLX's affine layout (gguf_weights.MLX_NATIVE_TYPES).
DENSE_TYPES = ("F32", "F16", "BF16")
DEQUANTIZED_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# Read into MLX's affine layout exactly (gguf_affine.py) instead of being dequantized.
AFFINE_TYPES = ("Q4_K", "Q5_K", "Q5_0", "Q5_1")


class GGUFFormatError(ValueError):
    """The file is not a readable GGUF file."""


@dataclass(frozen=True)
class GGUFHeader:
    """The parts of a GGUF header the loader checks before loading: architecture and tensor types."""

    version: int
    architecture: str | None
    tensor_types: dict[str, str]  # tensor name -> ggml type name
    num_elements: int = 0  # of every tensor together (what the weights take once dense)
    tensor_elements: dict[str, int] = field(default_factory=dict)  # tensor name -> its element count


def _read(f: BinaryIO, fmt: str) -> int:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise GGUFFormatError("the file ends inside its header (truncated?)")
    return int(struct.unpack(fmt, data)[0])


def _read_string(f: BinaryIO) -> str:
    n = _read(f, "<Q")
    data = f.read(n)
    if len(data) != n:
        raise GGUFFormatError("the file ends inside its header (truncated?)")
    return data.decode("utf-8", errors="replace")


def _skip_value(f: BinaryIO, vtype: int) -> None:
    if vtype == _STRING:
        f.seek(_read(f, "<Q"), 1)
    elif vtype == _ARRAY:
        etype, count = _read(f, "<I"), _read(f, "<Q")
        if etype in _SCALAR_SIZES:
            f.seek(_SCALAR_SIZES[etype] * count, 1)
        else:
            for _ in range(count):
                _skip_value(f, etype)
    elif vtype in _SCALAR_SIZES:
        f.seek(_SCALAR_SIZES[vtype], 1)
    else:
        raise GGUFFormatError(f"unknown metadata value type {vtype}")


def read_header(path: Path) -> GGUFHeader:
    """Parse the key/value section (keeping only general.architecture) and the tensor table."""
    with open(path, "rb") as f:
        if f.read(4) != _MAGIC:
            raise GGUFFormatError("it does not start with the GGUF magic bytes")
        version = _read(f, "<I")
        if version < 2:
            raise GGUFFormatError(f"GGUF version {version} is too old (need 2 or later)")
        n_tensors, n_kv = _read(f, "<Q"), _read(f, "<Q")
        architecture = None
        for _ in range(n_kv):
            key, vtype = _read_string(f), _read(f, "<I")
            if key == "general.architecture" and vtype == _STRING:
                architecture = _read_string(f)
            else:
                _skip_value(f, vtype)
        types: dict[str, str] = {}
        counts: dict[str, int] = {}
        elements = 0
        for _ in range(n_tensors):
            name = _read_string(f)
            count = 1
            for _ in range(_read(f, "<I")):  # the dims
                count *= _read(f, "<Q")
            elements += count
            counts[name] = count
            ggml_type = _read(f, "<I")
            f.seek(8, 1)  # the data offset
            types[name] = GGML_TYPE_NAMES.get(ggml_type, f"type {ggml_type}")
    return GGUFHeader(version, architecture, types, elements, counts)
