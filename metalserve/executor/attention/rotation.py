"""Quantized pages hold K and V rotated by an orthonormal Hadamard matrix along the head dim.

A model's keys carry a few outlier channels (RoPE pairs with large norms); with one int8 scale per token
and head, or one q4 scale per 32 channels, those outliers set the step size and the other channels lose
most of their bits. A Hadamard rotation H spreads every channel over all of them (QuaRot, SpinQuant), so
the same bytes quantize with several times less error, and attention needs nothing new:
  q . k = (q H) . (k H), and sum_i p_i v_i = (sum_i p_i (v_i H)) H^T,
so queries are rotated on the way in, K and V before they are quantized into the pages, and the output on
the way out. H is symmetric and its own inverse. Every backend (Metal kernels, numba, MLX ops) reads the
pages as before; this wrapper is the only place that knows. MLA's latent pages are never quantized and
pass through unrotated.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import numpy as np

from metalserve.executor.attention.base import AttentionBackend, AttentionCall, LayerCacheSpec
from metalserve.executor.step_inputs import StepInputs

_QUANTIZED_CODES = (mx.int8, mx.uint8)


def hadamard(dim: int) -> np.ndarray:
    """The orthonormal `[dim, dim]` rotation: Sylvester-Hadamard blocks of the largest power of two that
    divides `dim` on the diagonal (the whole matrix for 64, 128, 256; 16 x 5 for 80). Symmetric, H H = I."""
    block = dim & -dim
    sylvester = np.ones((1, 1))
    while sylvester.shape[0] < block:
        sylvester = np.block([[sylvester, sylvester], [sylvester, -sylvester]])
    return np.kron(np.eye(dim // block), sylvester / math.sqrt(block))


class RotatedPages(AttentionBackend[Any, Any]):
    """`inner`, with quantized layers' pages stored in the rotated basis (see the module docstring)."""

    def __init__(self, inner: AttentionBackend[Any, Any]) -> None:
        self.inner = inner
        self.name = inner.name
        self.description = f"{inner.description}, quantized pages Hadamard-rotated"
        self._rotations: dict[tuple[int, mx.Dtype], mx.array] = {}

    def allocate(self, spec: LayerCacheSpec) -> Any:
        return self.inner.allocate(spec)

    def extend(self, cache: Any, spec: LayerCacheSpec) -> Any:
        return self.inner.extend(cache, spec)

    def truncate(self, cache: Any, spec: LayerCacheSpec) -> Any:
        return self.inner.truncate(cache, spec)

    def build_metadata(self, step: StepInputs, spec: LayerCacheSpec) -> Any:
        return self.inner.build_metadata(step, spec)

    def forward(self, call: AttentionCall[Any, Any]) -> mx.array:
        if call.v is None or call.cache.arrays()[0].dtype not in _QUANTIZED_CODES:
            return self.inner.forward(call)
        out = self.inner.forward(call._replace(q=self.rotate(call.q), k=self.rotate(call.k), v=self.rotate(call.v)))
        return self.rotate(out)

    def rotate(self, x: mx.array) -> mx.array:
        """`x @ hadamard(D)` along the last axis. For a power of two that is MLX's fast Walsh-Hadamard
        transform (the same Sylvester matrix, O(D log D): 8x faster than the matmul on 512 x 9 x 64 here)."""
        dim = x.shape[-1]
        if dim & (dim - 1) == 0:
            return mx.hadamard_transform(x)
        key = (dim, x.dtype)
        if key not in self._rotations:
            self._rotations[key] = mx.array(hadamard(dim), dtype=x.dtype)
        return x @ self._rotations[key]
