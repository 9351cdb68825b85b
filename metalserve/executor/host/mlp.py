"""mlx-lm's gated MLP with its gate and up projections fused and its activation on the host.

For MLX's CPU backend only: the projections stay MLX matmuls (one for gate and up together), the
SwiGLU runs in `metalserve.kernels.cpu.swiglu`, whose exp is vectorised where MLX's is not.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.activations import swiglu as mlx_swiglu

from metalserve.executor.models.fused_linear import fuse_linears

# mlx-lm MLP classes computed as down_proj(swiglu(gate_proj(x), up_proj(x))).
SWIGLU_MLPS = {"mlx_lm.models.llama.MLP", "mlx_lm.models.qwen2.MLP", "mlx_lm.models.qwen3.MLP"}


def is_swiglu_mlp(mlp: nn.Module) -> bool:
    return f"{type(mlp).__module__}.{type(mlp).__qualname__}" in SWIGLU_MLPS


class HostSwiGLUMLP(nn.Module):
    """Replaces one layer's `mlp`; float32 activations take the host path, others mlx-lm's own SwiGLU."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        if not is_swiglu_mlp(inner):
            raise ValueError(f"{type(inner).__module__}.{type(inner).__qualname__} is not a known SwiGLU MLP")
        self.inner = inner
        self.gate_up_proj = fuse_linears([inner.gate_proj, inner.up_proj])
        if self.gate_up_proj is not None:  # the separate projections are dropped so weights are not held twice
            for name in ("gate_proj", "up_proj"):
                inner.pop(name)

    def __call__(self, x: mx.array) -> mx.array:
        from metalserve.kernels.cpu.swiglu import swiglu

        if self.gate_up_proj is None:
            return self.inner(x)
        gate_up = self.gate_up_proj(x)
        if gate_up.dtype != mx.float32:
            gate, up = mx.split(gate_up, 2, axis=-1)
            return self.inner.down_proj(mlx_swiglu(gate, up))
        mx.eval(gate_up)
        hidden = swiglu(np.asarray(gate_up).reshape(-1, gate_up.shape[-1]))
        return self.inner.down_proj(mx.array(hidden).reshape(*x.shape[:-1], -1))
