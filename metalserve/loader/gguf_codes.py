"""GGUF quantized matrices as packed codes for the CPU path (metalserve/kernels/cpu/packed_codes.py).

Every type metalserve reads has groups of 16 or 32 values sharing a scale and an offset, so each maps
onto `w = scale * q + offset` exactly (the products of an fp16 and a small integer are exact in fp32):
Q4_0 `d * (q - 8)`, Q4_1 `d * q + m`, Q8_0 `d * q` (q + 128 stored unsigned, offset -128 d), Q5_0/Q5_1
and the K-quants through the repackers gguf_affine.py uses for MLX, Q6_K `d * sc * (q - 32)` in groups
of 16. Q2_K and Q3_K are left to the dense route (None).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from metalserve.kernels.cpu.packed_codes import PackedCodes
from metalserve.loader.affine_codes import unpack_codes
from metalserve.loader.gguf_affine import AFFINE
from metalserve.loader.gguf_kquants import q6_k_codes
from metalserve.loader.gguf_reader import GGUFFile, TensorInfo, release_pages

_CHUNK_VALUES = 1 << 18
_EMBEDDING, _HEAD = "token_embd.weight", "output.weight"


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 16 bytes of a 32-block: low nibbles are values 0-15, high ones 16-31."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> 4], axis=1)


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    d = _half(blocks, 0)
    return _nibbles(blocks[:, 2:18]), d, d * np.float32(-8.0), 4


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    return _nibbles(blocks[:, 4:20]), _half(blocks, 0), _half(blocks, 2), 4


def _q8_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    d = _half(blocks, 0)
    codes = (blocks[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return codes, d, d * np.float32(-128.0), 8


def _q6_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    d = _half(blocks, 208)
    scale = d * blocks[:, 192:208].view(np.int8).astype(np.float32)  # (n, 16): one per 16 values
    return q6_k_codes(blocks).reshape(-1, 256), scale, scale * np.float32(-32.0), 6


def _affine(kind: str) -> tuple[int, int, object]:
    size, values, bits, repack = AFFINE[kind]

    def codes(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        packed, scale, bias = repack(blocks)
        unpacked = unpack_codes(np.ascontiguousarray(packed).reshape(blocks.shape[0], -1), bits)
        return unpacked, scale.reshape(blocks.shape[0], -1), bias.reshape(blocks.shape[0], -1), bits

    return size, values, codes


# type -> (block bytes, values per block, blocks -> (codes (n, values), scales, offsets, bits))
_TYPES = {
    "Q4_0": (18, 32, _q4_0),
    "Q4_1": (20, 32, _q4_1),
    "Q8_0": (34, 32, _q8_0),
    "Q6_K": (210, 256, _q6_k),
    **{kind: _affine(kind) for kind in AFFINE},
}
CODES_TYPES = tuple(_TYPES)


def packed_codes(raw: np.ndarray, kind: str, shape: tuple[int, ...]) -> PackedCodes:
    """A 2-D quantized tensor's bytes (`raw` uint8, `shape` `[rows, columns]`) as packed codes, converted a
    chunk of rows at a time into arrays allocated once (joining chunks afterwards held the tensor twice: the
    coder 0.5B's 164 MB head at the load's peak)."""
    size, values, convert = _TYPES[kind]
    rows, columns = shape
    per_row = columns // values
    blocks = raw.reshape(rows, per_row * size)
    step = max(1, _CHUNK_VALUES // columns)
    out: PackedCodes | None = None
    for start in range(0, rows, step):
        chunk = blocks[start : start + step].reshape(-1, size)
        codes, scales, biases, bits = convert(chunk)  # type: ignore[operator]
        n = chunk.shape[0] // per_row
        part = PackedCodes.pack(codes.reshape(n, columns), scales.reshape(n, -1), biases.reshape(n, -1), bits)
        if n == rows:
            return part
        if out is None:
            groups = part.scales.shape[1]
            out = PackedCodes(
                np.empty((rows, part.codes.shape[1]), np.uint8),
                np.empty((rows, groups), np.float16),
                np.empty((rows, groups), np.float16),
                part.bits,
                columns,
            )
        out.codes[start : start + n], out.scales[start : start + n], out.biases[start : start + n] = (
            part.codes,
            part.scales,
            part.biases,
        )
    assert out is not None  # rows > 0: the loop ran
    return out


# Bytes a weight takes once packed (kernels/cpu/packed_codes.py): the code's stored width, plus a float16
# scale and offset per group (16 values for Q6_K, else 32). Tensors of other types stay fp32 (4 bytes).
_PACKED_BYTES_PER_WEIGHT = {"Q4_0": 0.625, "Q4_1": 0.625, "Q4_K": 0.625, "Q5_0": 0.75, "Q5_1": 0.75}
_PACKED_BYTES_PER_WEIGHT |= {"Q5_K": 0.75, "Q6_K": 1.0, "Q8_0": 1.125}


def packed_bytes(tensor_types: dict[str, str], tensor_elements: dict[str, int]) -> int:
    """What a GGUF's tensors take on the codes path, from its header alone (the registry's estimate)."""
    return int(sum(n * _PACKED_BYTES_PER_WEIGHT.get(tensor_types[t], 4.0) for t, n in tensor_elements.items()))


@dataclass(frozen=True)
class FileRows:
    """An embedding table left in the GGUF's bytes (the file's memory map), its rows converted when looked
    up. An untied table is read a few rows a step; converted whole it held its size in resident memory
    (the coder 0.5B's Q5_0 embedding: 114 MB) for bytes the page cache keeps anyway."""

    raw: np.ndarray  # uint8 [rows, the file's bytes a row]
    kind: str
    columns: int

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.raw.shape[0]), self.columns)

    @property
    def nbytes(self) -> int:
        """Bytes held beyond the file's mapped pages: none."""
        return 0

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """The fp32 rows `ids` `[len(ids), columns]`."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.raw.shape[0]):
            raise ValueError(f"row ids must lie in [0, {self.raw.shape[0]})")
        if ids.size == 0:
            return np.zeros((0, self.columns), np.float32)
        picked = np.ascontiguousarray(self.raw[ids]).reshape(-1)
        return packed_codes(picked, self.kind, (int(ids.size), self.columns)).dense()


def keeps_codes(info: TensorInfo) -> bool:
    return info.kind in _TYPES and len(info.shape) == 2 and info.name.endswith(".weight")


def read_with_codes(file: GGUFFile) -> tuple[dict[str, mx.array], dict[str, PackedCodes | FileRows]]:
    """Every tensor of the file: quantized matrices as packed codes (with a lazy zero stand-in of their
    shape among the MLX tensors, which the model builder needs and `swap_in_codes` drops unevaluated),
    an embedding the head does not share left in the file (FileRows), the rest as gguf_dequant.py reads
    them."""
    from metalserve.loader.gguf_dequant import read_tensors

    coded = {name: info for name, info in file.tensors.items() if keeps_codes(info)}
    left: dict[str, PackedCodes | FileRows] = {}
    embedding = coded.get(_EMBEDDING)
    if embedding is not None and _HEAD in file.tensors:  # untied: only looked up, a few rows a step
        rows, columns = embedding.shape
        raw = file.data[embedding.start : embedding.start + embedding.nbytes].reshape(rows, -1)
        left[_EMBEDDING] = FileRows(raw, embedding.kind, columns)
        del coded[_EMBEDDING]
    rest = GGUFFile(
        file.metadata, {n: i for n, i in file.tensors.items() if n not in coded and n not in left}, file.data
    )
    tensors = read_tensors(rest, mx.float32)

    def convert(info: TensorInfo) -> PackedCodes:
        packed = packed_codes(file.data[info.start : info.start + info.nbytes], info.kind, info.shape)
        release_pages(file, info)  # the file's pages read for it no longer count in this process's memory
        return packed

    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        codes: dict[str, PackedCodes | FileRows] = dict(zip(coded, pool.map(convert, coded.values()), strict=True))
    codes |= left
    for name, table in codes.items():
        tensors[name] = mx.zeros(table.shape, mx.float32)
    return tensors, codes
