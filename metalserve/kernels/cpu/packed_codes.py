"""Quantized weights as the CPU path keeps them: packed integer codes with a scale and offset per group.

`w[r, c] = scales[r, g] * q[r, c] + biases[r, g]` with `g = c // group_size`, as in MLX's affine layout
and in every GGUF type metalserve reads (Q4_0 is `d * (q - 8)`: scale d, offset -8 d; Q6_K's groups are
16 wide). The codes stay packed, so a weight costs what the file spends on it, not four bytes of fp32:

- 4 bits: half a byte. Byte i of a row holds column i in its low nibble and column i + columns/2 in its
  high one, so the kernel unpacks a row with contiguous vector loops (a per-block order, ggml's, left
  LLVM with 16-iteration loops it unrolled to scalar code: ten times slower).
- 5 and 6 bits: those nibbles, then the high bits of the row in a tail of bit planes: tail byte i holds
  column i + q * columns/8 in bit q (5 bits), or column i + q * columns/4 in bits 2q, 2q+1 (6 bits).
- 8 bits: one byte a weight. Codes of 2, 3 and 7 bits are stored as 4 and 8 bits, unchanged.

Scales and offsets are float16: a bit a weight for groups of 32 (fp32 took two, which put the coder 0.5B's
weights at 474 MiB against its GGUF's 469 MiB). A GGUF's scale is a float16 times a small integer (Q4_K's 6-bit
sub-scale, Q6_K's int8), so rounding it to float16 errs by at most 2^-11 of itself; MLX's fp16 scales are
kept exactly, its bf16 ones exactly within float16's normal range and to 2^-24 absolute below it.

Plain NumPy here: the loader builds these, the numba kernels (packed_linear.py) read them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

STORED_BITS = (4, 5, 6, 8)
_BLOCK = 32  # columns per packing block; every row's width is a multiple of it


def stored_bits(bits: int) -> int:
    """The width codes of `bits` bits are kept at (the narrowest of STORED_BITS that holds them)."""
    if not 1 <= bits <= 8:
        raise ValueError(f"codes of {bits} bits cannot be packed (1 to 8)")
    return next(b for b in STORED_BITS if b >= bits)


def row_bytes(bits: int, columns: int) -> int:
    """Bytes one row of `columns` codes takes at `bits` (one of STORED_BITS)."""
    return columns if bits == 8 else columns // 2 + columns * (bits - 4) // 8


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    rows, columns = codes.shape
    if bits == 8:
        return np.ascontiguousarray(codes, np.uint8)
    half = columns // 2
    parts = [(codes[:, :half] & 0x0F) | ((codes[:, half:] & 0x0F) << 4)]
    if bits > 4:
        planes = 8 // (bits - 4)  # columns sharing a tail byte: 8 one-bit or 4 two-bit planes
        high = (codes >> 4).reshape(rows, planes, columns // planes)  # [.., plane q, byte i]
        shifts = ((bits - 4) * np.arange(planes, dtype=np.uint8))[:, None]
        parts.append(np.bitwise_or.reduce(high << shifts, axis=1))
    return np.ascontiguousarray(np.concatenate(parts, axis=1), np.uint8)


def _unpack(packed: np.ndarray, bits: int, columns: int) -> np.ndarray:
    if bits == 8:
        return packed.copy()
    half = columns // 2
    low = packed[:, :half]
    codes = np.concatenate([low & 0x0F, low >> 4], axis=1)
    if bits > 4:
        width = bits - 4
        planes = 8 // width
        tail = packed[:, half:]
        shifts = (width * np.arange(planes, dtype=np.uint8))[None, :, None]
        high = (tail[:, None, :] >> shifts) & ((1 << width) - 1)  # [rows, plane, byte]
        codes |= high.reshape(codes.shape) << 4
    return codes


def to_half(values: np.ndarray) -> np.ndarray:
    """`values` as contiguous float16; an error where one is beyond float16's range (65504)."""
    with np.errstate(over="ignore"):
        half = np.ascontiguousarray(values, np.float16)
    if not np.isfinite(half).all() and np.isfinite(values).all():
        raise ValueError("a scale or offset exceeds float16's range; these weights cannot be packed")
    return half


def half_bits(values: np.ndarray) -> np.ndarray:
    """float16 values as their uint16 bits (the kernels' view of scales and offsets)."""
    if values.dtype != np.float16:
        raise ValueError(f"expected float16 values, got {values.dtype}")
    return values.view(np.uint16)


@dataclass(frozen=True)
class PackedCodes:
    """`codes` uint8 `[rows, row_bytes(bits, columns)]`; `scales`, `biases` float16 `[rows, groups]` (the
    kernels take them as their uint16 bits: numba has no float16)."""

    codes: np.ndarray
    scales: np.ndarray
    biases: np.ndarray
    bits: int
    columns: int

    def __post_init__(self) -> None:
        rows = self.codes.shape[0]
        if self.bits not in STORED_BITS or self.columns % _BLOCK:
            raise ValueError(f"packed codes are {STORED_BITS} bits over a multiple of {_BLOCK} columns")
        if self.codes.dtype != np.uint8 or self.codes.shape != (rows, row_bytes(self.bits, self.columns)):
            raise ValueError(f"codes must be uint8 [{rows}, {row_bytes(self.bits, self.columns)}]")
        groups = self.scales.shape[1] if self.scales.ndim == 2 else 0
        bad_groups = not groups or self.columns % groups or (self.columns // groups) % 16
        if self.scales.shape != (rows, groups) or self.biases.shape != (rows, groups) or bad_groups:
            raise ValueError(f"scales {self.scales.shape} and biases {self.biases.shape} do not group {self.shape}")
        if self.scales.dtype != np.float16 or self.biases.dtype != np.float16:
            raise ValueError("scales and biases must be float16")

    @staticmethod
    def pack(codes: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int) -> PackedCodes:
        """From unpacked codes (`[rows, columns]`, each below 2**bits) and their scales and offsets (any
        float type; rounded to float16)."""
        width = stored_bits(bits)
        packed = _pack(np.asarray(codes, np.uint8), width)
        scales, biases = (to_half(a) for a in (scales, biases))
        return PackedCodes(packed, scales, biases, width, int(codes.shape[1]))

    def kernel_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(codes, scales, biases) flat, the scales and offsets as their uint16 bits: what the kernels take."""
        codes, scales, biases = (np.ascontiguousarray(a) for a in (self.codes, self.scales, self.biases))
        return codes.reshape(-1), half_bits(scales).reshape(-1), half_bits(biases).reshape(-1)

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.codes.shape[0]), self.columns)

    @property
    def group_size(self) -> int:
        return self.columns // int(self.scales.shape[1])

    @property
    def nbytes(self) -> int:
        return int(self.codes.nbytes + self.scales.nbytes + self.biases.nbytes)

    def unpacked(self) -> np.ndarray:
        """The codes, one uint8 a weight `[rows, columns]`."""
        return _unpack(self.codes, self.bits, self.columns)

    def dense(self) -> np.ndarray:
        """The float32 weights these codes stand for."""
        rows, groups = self.scales.shape
        w = self.unpacked().reshape(rows, groups, -1).astype(np.float32)
        w *= self.scales.astype(np.float32)[:, :, None]
        w += self.biases.astype(np.float32)[:, :, None]
        return w.reshape(rows, self.columns)

    def take_rows(self, index: np.ndarray) -> PackedCodes:
        """These codes with their rows reordered (a row's codes, scales and offsets move together)."""
        return PackedCodes(self.codes[index], self.scales[index], self.biases[index], self.bits, self.columns)

    @staticmethod
    def concatenate(parts: list[PackedCodes]) -> PackedCodes | None:
        """The row-wise concatenation (a fused projection); None unless every part packs alike."""
        if len({(p.bits, p.columns, p.group_size) for p in parts}) != 1:
            return None
        codes, scales, biases = (np.concatenate([getattr(p, f) for p in parts]) for f in ("codes", "scales", "biases"))
        return PackedCodes(codes, scales, biases, parts[0].bits, parts[0].columns)
