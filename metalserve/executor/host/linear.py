"""A dense linear layer that, for steps of a few tokens, multiplies on the host from its stored codes.

For MLX's CPU backend only. Prefill-sized steps keep MLX's matmul on the fp32 weights (MKL); a step of at
most `max_tokens` tokens runs `metalserve.kernels.cpu.affine_linear`, which reads a quarter of the bytes.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from metalserve.kernels.cpu.affine_codes import AffineCodes

# bench/affine_linear.py, over the default model's projections: the codes kernel beat MKL's fp32 matmul
# 4x at 1 token, 3x at 8, 2x at 32, 1.5x at 64, 1.1x at 256, and tied at 512. Whole prefill steps on the
# host (forward.py) ran 1.17x faster than through MLX at 512 tokens and 0.92x at 2048.
HOST_LINEAR_MAX_TOKENS = 512


def host_codes(linear: nn.Module | None, codes: AffineCodes | None) -> AffineCodes | None:
    """`codes` if they stand for the weights of `linear`, a dense float32 `nn.Linear`; else None."""
    if codes is None or type(linear) is not nn.Linear or linear.weight.dtype != mx.float32:
        return None
    return codes if codes.codes.shape == tuple(linear.weight.shape) else None


class HostLinear(nn.Module):
    """Wraps an `nn.Linear` that has codes (see `host_codes`); same inputs, same outputs."""

    def __init__(self, inner: nn.Linear, codes: AffineCodes, max_tokens: int = HOST_LINEAR_MAX_TOKENS) -> None:
        super().__init__()
        self.inner = inner
        self.codes = codes
        self.max_tokens = max_tokens

    def host(self, x: np.ndarray) -> np.ndarray:
        """`[T, in]` float32 -> `[T, out]` from the codes (plus the bias), whatever `T`."""
        from metalserve.kernels.cpu.affine_linear import affine_linear

        out = affine_linear(x, self.codes)
        if "bias" in self.inner:
            out += np.asarray(self.inner.bias)
        return out

    def __call__(self, x: mx.array) -> mx.array:
        tokens = x.size // x.shape[-1]
        if tokens > self.max_tokens or x.dtype != mx.float32:
            return self.inner(x)
        mx.eval(x)
        return mx.array(self.host(np.asarray(x).reshape(tokens, -1))).reshape(*x.shape[:-1], -1)
