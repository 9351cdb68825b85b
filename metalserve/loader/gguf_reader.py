"""Read a whole GGUF file without MLX: metadata as Python values, tensors as views of a memory map.

`mx.load` reads F32/F16 and Q4_0/Q4_1/Q8_0 (into MLX's affine layout) but rounds BF16 and the K-quants
to fp16 and fails on Q5_0/Q5_1; files with those types are read here. gguf's own GGUFReader builds a
numpy view per vocabulary string (seconds for a 150k vocabulary); this parser reads them in one pass.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from metalserve.loader.gguf_header import GGML_TYPE_NAMES, GGUFFormatError

_MAGIC = b"GGUF"
_STRING, _ARRAY, _BOOL = 8, 9, 7
# Metadata value type id -> numpy dtype (GGUF is little-endian).
_NUMPY = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "<u1",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the table: numpy-order shape, ggml type name and byte range in the file."""

    name: str
    shape: tuple[int, ...]  # numpy order: GGUF lists the fastest dimension first
    kind: str  # ggml type name, e.g. "Q4_K"
    start: int  # absolute byte offset
    nbytes: int


@dataclass(frozen=True)
class GGUFFile:
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data: np.ndarray  # uint8 memory map of the whole file


class _Cursor:
    """Little-endian reads over a buffer, with a clear error when the file ends too early."""

    def __init__(self, buf: np.ndarray) -> None:
        self.buf, self.pos = buf.data, 0

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise GGUFFormatError("the file ends inside its header (truncated?)")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> int:
        return int(struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0])

    def string(self) -> str:
        return bytes(self.take(self.unpack("<Q"))).decode("utf-8", errors="replace")


def _value(cur: _Cursor, vtype: int) -> Any:
    if vtype == _STRING:
        return cur.string()
    if vtype == _ARRAY:
        etype, count = cur.unpack("<I"), cur.unpack("<Q")
        if etype in _NUMPY:
            dtype = np.dtype(_NUMPY[etype])
            values = np.frombuffer(cur.take(dtype.itemsize * count), dtype=dtype).tolist()
            return [bool(v) for v in values] if etype == _BOOL else values
        return [_value(cur, etype) for _ in range(count)]
    if vtype in _NUMPY:
        dtype = np.dtype(_NUMPY[vtype])
        scalar = np.frombuffer(cur.take(dtype.itemsize), dtype=dtype)[0].item()
        return bool(scalar) if vtype == _BOOL else scalar
    raise GGUFFormatError(f"unknown metadata value type {vtype}")


def _tensor_nbytes(kind_id: int, shape: tuple[int, ...]) -> int:
    import gguf  # only files read here need it

    try:
        kind = gguf.GGMLQuantizationType(kind_id)
    except ValueError as exc:
        raise GGUFFormatError(f"unknown tensor type {kind_id}") from exc
    block, size = gguf.GGML_QUANT_SIZES[kind]
    count = int(np.prod(shape, dtype=np.int64))
    if shape and shape[-1] % block:
        raise GGUFFormatError(f"a {kind.name} tensor's rows ({shape[-1]}) are not whole blocks of {block}")
    return count // block * size


def read_gguf(path: Path) -> GGUFFile:
    """Parse the header and tensor table; the tensors stay on disk until read."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(data)
    if bytes(cur.take(4)) != _MAGIC:
        raise GGUFFormatError("it does not start with the GGUF magic bytes")
    version = cur.unpack("<I")
    if version < 2:
        raise GGUFFormatError(f"GGUF version {version} is too old (need 2 or later)")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = _value(cur, cur.unpack("<I"))
    table = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.unpack("<Q") for _ in range(cur.unpack("<I"))]
        table.append((name, tuple(reversed(dims)), cur.unpack("<I"), cur.unpack("<Q")))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    base = -(-cur.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, shape, kind_id, offset in table:
        nbytes = _tensor_nbytes(kind_id, shape)
        if base + offset + nbytes > len(data):
            raise GGUFFormatError(f"the tensor {name!r} runs past the end of the file (truncated?)")
        kind = GGML_TYPE_NAMES.get(kind_id, f"type {kind_id}")
        tensors[name] = TensorInfo(name, shape, kind, base + offset, nbytes)
    return GGUFFile(metadata, tensors, data)


def release_pages(file: GGUFFile, info: TensorInfo) -> None:
    """Drop the pages of `info`'s bytes from this process's mapping of the file (`MADV_DONTNEED`; they stay
    in the page cache, and a later read maps them again). A loaded model holds its own converted copy, so
    the file's pages it read would otherwise count in the server's resident memory until the map closes:
    the whole GGUF at the load's peak. A no-op where the platform has no madvise."""
    mapping = getattr(file.data, "_mmap", None)
    advice = getattr(mmap, "MADV_DONTNEED", None)
    if mapping is None or advice is None:
        return
    page = mmap.PAGESIZE
    start = info.start // page * page
    end = min(-(-(info.start + info.nbytes) // page) * page, len(mapping))
    if end > start:
        mapping.madvise(advice, start, end - start)
