"""The array library the sampler computes with: MLX, or NumPy when MLX runs on the CPU.

Micro-benchmarks on the shared 2-core x86 CPU (B=32, vocab 49152): MLX's CPU backend took about 7x
longer than NumPy for exp, 15x for a top-k partition and 20-40x for the sparse gathers and scatters of
the penalties, while moving the logits into NumPy costs about 1 ms. On a GPU the MLX path keeps
everything on the device.
The sampling code is written once against `xp` (the functions both libraries name alike) plus the few
operations below, so both paths run the same lines and the tests run both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

Array = Any  # an mx.array or an np.ndarray, depending on the backend


class ArrayBackend:
    """MLX operations; NumpyBackend overrides the ones whose spelling differs."""

    name = "mlx"
    xp: Any = mx
    # Logits are scaled to base 2 here because MLX's CPU backend computes 2**y about twice as fast as exp.
    log_base = 2.0
    row_chunk: int | None = None  # sample this many rows at a time (None: all at once)

    def asarray(self, values: Sequence[float] | Sequence[int] | np.ndarray, dtype: str = "float32") -> Array:
        data = values if isinstance(values, np.ndarray) else list(values)
        return mx.array(data, dtype=getattr(mx, dtype))

    def from_mlx(self, x: mx.array) -> Array:
        return x

    def copy(self, x: Array) -> Array:
        """An array that scatters may change without changing x (MLX arrays are never changed)."""
        return x

    def exp(self, y: Array) -> Array:
        """The base-`log_base` exponential."""
        return mx.power(2.0, y)

    def log(self, value: float) -> float:
        """The base-`log_base` logarithm of a host number (-inf for 0)."""
        return math.log2(value) if value > 0 else -math.inf

    def ln(self, y: Array) -> Array:
        return mx.log(y)

    def top(self, y: Array, k: int) -> Array:
        """The k largest values of each row, best first."""
        top = y if k >= y.shape[-1] else mx.topk(y, k, axis=-1)
        return -mx.sort(-top, axis=-1)

    def top_indices(self, y: Array, k: int) -> Array:
        """Indices of the k largest values of each row, in no particular order."""
        return mx.argpartition(-y, kth=k - 1, axis=-1)[:, :k]

    def scatter(self, x: Array, rows: Array, cols: Array, values: Array, op: str) -> Array:
        """x with x[rows, cols] combined with values by op ("add", "multiply" or "minimum"); the
        (row, col) pairs must be distinct."""
        return getattr(x.at[rows, cols], op)(values)

    def add_rows(self, x: Array, rows: list[int], bias: np.ndarray) -> Array:
        """x with bias[i] added to row rows[i] (a host array; the grammar masks are 0 / -inf)."""
        if len(rows) != x.shape[0]:
            full = np.zeros(x.shape, np.float32)
            full[rows] = bias
            bias = full
        return x + mx.array(bias)

    def evaluate(self, *arrays: Array) -> None:
        mx.eval(*arrays)


class NumpyBackend(ArrayBackend):
    """NumPy on the host, for MLX's CPU backend; scatters update the array in place."""

    name = "numpy"
    xp = np
    log_base = math.e  # NumPy's exp is its fastest exponential
    # Eight rows of a 49152 vocabulary keep each temporary near 1.5 MB, in cache: 1.5x less CPU at B=32.
    row_chunk = 8

    def asarray(self, values: Sequence[float] | Sequence[int] | np.ndarray, dtype: str = "float32") -> Array:
        return np.asarray(values, dtype=getattr(np, dtype))

    def from_mlx(self, x: mx.array) -> Array:
        return np.array(x.astype(mx.float32) if x.dtype != mx.float32 else x)

    def copy(self, x: Array) -> Array:
        return x.copy()

    def exp(self, y: Array) -> Array:
        with np.errstate(under="ignore"):
            return np.exp(y)

    def log(self, value: float) -> float:
        return math.log(value) if value > 0 else -math.inf

    def ln(self, y: Array) -> Array:
        return np.log(y)

    def top(self, y: Array, k: int) -> Array:
        top = y if k >= y.shape[-1] else np.partition(y, y.shape[-1] - k, axis=-1)[:, -k:]
        return -np.sort(-top, axis=-1)

    def top_indices(self, y: Array, k: int) -> Array:
        return np.argpartition(y, y.shape[-1] - k, axis=-1)[:, y.shape[-1] - k :]

    def scatter(self, x: Array, rows: Array, cols: Array, values: Array, op: str) -> Array:
        x[rows, cols] = getattr(np, op)(x[rows, cols], values)
        return x

    def add_rows(self, x: Array, rows: list[int], bias: np.ndarray) -> Array:
        if len(rows) != x.shape[0]:  # some rows: spread the bias over the batch, then one add still
            full = np.zeros(x.shape, np.float32)
            full[rows] = bias
            bias = full
        np.add(x, bias, out=x)  # in place
        return x

    def evaluate(self, *arrays: Array) -> None:
        return None


def pick_backend(name: str = "auto") -> ArrayBackend:
    """ "mlx", "numpy", or "auto": NumPy when MLX runs on the CPU (the Platform's answer)."""
    if name == "auto":
        from metalserve.platform import current_platform

        name = "numpy" if current_platform().on_cpu else "mlx"
    if name == "mlx":
        return ArrayBackend()
    if name == "numpy":
        return NumpyBackend()
    raise ValueError(f"unknown sampler backend {name!r}: expected 'auto', 'mlx' or 'numpy'")
