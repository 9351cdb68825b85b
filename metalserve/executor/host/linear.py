"""A linear layer that, for steps of a few tokens, multiplies on the host from its packed codes.

For MLX's CPU backend only. Where the loader kept an fp32 copy (`--weights dequantize`, or a model
directory), prefill-sized steps keep MLX's matmul on it (MKL); a step of at most `max_tokens` tokens runs
`metalserve.kernels.cpu.packed_linear`, which reads an eighth to a quarter of the bytes. Where the loader
kept only the codes (a `CodesLinear`, the GGUF default), every step reads them.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from metalserve.kernels.cpu.packed_codes import PackedCodes
from metalserve.loader.codes_linear import CodeParts, CodesLinear

# bench/affine_linear.py, over the default model's projections: the codes kernel beat MKL's fp32 matmul
# 4x at 1 token, 3x at 8, 2x at 32, 1.5x at 64, 1.1x at 256, and tied at 512. Whole prefill steps on the
# host (forward.py) ran 1.17x faster than through MLX at 512 tokens and 0.92x at 2048.
HOST_LINEAR_MAX_TOKENS = 512


def host_codes(linear: nn.Module | None, parts: Sequence[PackedCodes | None]) -> tuple[PackedCodes, ...] | None:
    """`parts` (row blocks, top to bottom) if together they stand for the weights of `linear`, a dense
    float32 `nn.Linear`; the blocks of a `CodesLinear` itself; else None."""
    if isinstance(linear, CodesLinear):
        return linear.parts
    if not parts or any(p is None for p in parts) or type(linear) is not nn.Linear:
        return None
    if linear.weight.dtype != mx.float32:
        return None
    found = tuple(p for p in parts if p is not None)
    shape = (sum(p.shape[0] for p in found), found[0].columns)
    return found if shape == tuple(linear.weight.shape) and len({p.columns for p in found}) == 1 else None


class HostLinear(nn.Module):
    """Wraps an `nn.Linear` or `CodesLinear` that has codes (see `host_codes`); same inputs, same outputs."""

    def __init__(
        self, inner: nn.Module, codes: Sequence[PackedCodes], max_tokens: int = HOST_LINEAR_MAX_TOKENS
    ) -> None:
        super().__init__()
        self.inner = inner
        bias = np.asarray(inner.bias) if "bias" in inner else None
        self.code_parts = CodeParts(tuple(codes), bias)
        # Without an fp32 copy the codes serve every step.
        self.max_tokens = max_tokens if type(inner) is nn.Linear else 1 << 62

    @property
    def codes(self) -> tuple[PackedCodes, ...]:
        return self.code_parts.parts

    def host(self, x: np.ndarray) -> np.ndarray:
        """`[T, in]` float32 -> `[T, out]` from the codes (plus the bias), whatever `T`."""
        from metalserve.kernels.cpu.packed_linear import packed_linear

        return packed_linear(x, self.code_parts.segments())

    def __call__(self, x: mx.array) -> mx.array:
        tokens = x.size // x.shape[-1]
        if tokens > self.max_tokens or x.dtype != mx.float32:
            return self.inner(x)
        mx.eval(x)
        return mx.array(self.host(np.asarray(x).reshape(tokens, -1))).reshape(*x.shape[:-1], -1)
