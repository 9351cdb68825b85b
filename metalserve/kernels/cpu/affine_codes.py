"""The integer codes of an MLX affine-quantized weight, one byte each, as the loader unpacks them.

A GGUF Q4_0/Q4_1/Q8_0 tensor loads into MLX's affine layout: `w[r, c] = scales[r, g] * q[r, c] +
biases[r, g]` with `g = c // group_size`. Dequantizing gives fp32 weights that MKL multiplies fast in
prefill; decoding a few tokens is bound by reading those weights instead, so the host path keeps the codes,
packed again (`metalserve.kernels.cpu.packed_codes`). The loader extracts them
(metalserve/loader/affine_codes.py); plain NumPy here, so kernels need nothing from the loader.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class AffineCodes:
    """`codes` uint8 `[out, in]`; `scales` and `biases` float32 `[out, in // group_size]`."""

    codes: np.ndarray
    scales: np.ndarray
    biases: np.ndarray

    def __post_init__(self) -> None:
        rows, cols = self.codes.shape
        if self.codes.dtype != np.uint8 or self.scales.dtype != np.float32 or self.biases.dtype != np.float32:
            raise ValueError("codes must be uint8 and scales and biases float32")
        groups = self.scales.shape[1] if self.scales.ndim == 2 else 0
        if self.scales.shape != (rows, groups) or self.biases.shape != (rows, groups) or not groups or cols % groups:
            raise ValueError(
                f"scales {self.scales.shape} and biases {self.biases.shape} do not group codes {self.codes.shape}"
            )

    @property
    def group_size(self) -> int:
        return int(self.codes.shape[1] // self.scales.shape[1])

    def dense(self) -> np.ndarray:
        """The float32 weights these codes stand for."""
        g = self.group_size
        return np.repeat(self.scales, g, axis=1) * self.codes + np.repeat(self.biases, g, axis=1)

    @staticmethod
    def concatenate(parts: list[AffineCodes]) -> AffineCodes | None:
        """Codes of the row-wise concatenation of `parts` (a fused projection); None if groups differ."""
        if len({p.group_size for p in parts}) != 1:
            return None
        return AffineCodes(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("codes", "scales", "biases")))
