"""mlx-lm's gated MLP with its gate and up projections fused and its activation on the host.

For MLX's CPU backend only: the projections stay MLX matmuls (one for gate and up together), the
activation (SwiGLU, or gemma3's GELU-tanh gate) runs in `metalserve.kernels.cpu.swiglu`, whose exp and
tanh vectorise where MLX's do not.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.activations import swiglu as mlx_swiglu

from metalserve.executor.models.fused_linear import fuse_linears

# mlx-lm MLP classes computed as down_proj(act(gate) * up), by their activation: gate and up as separate
# projections, or phi3's one `gate_up_proj` (gate rows first).
GATED_MLPS = {
    "mlx_lm.models.llama.MLP": "silu",
    "mlx_lm.models.qwen2.MLP": "silu",
    "mlx_lm.models.qwen3.MLP": "silu",
    "mlx_lm.models.phi3.MLP": "silu",
    "mlx_lm.models.gemma3_text.MLP": "gelu_tanh",
}


def _name(mlp: nn.Module) -> str:
    return f"{type(mlp).__module__}.{type(mlp).__qualname__}"


def is_gated_mlp(mlp: nn.Module) -> bool:
    return _name(mlp) in GATED_MLPS


class HostGatedMLP(nn.Module):
    """Replaces one layer's `mlp`; float32 activations take the host path, others mlx-lm's own activation."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        if not is_gated_mlp(inner):
            raise ValueError(f"{_name(inner)} is not a known gated MLP")
        self.inner = inner
        self.activation = GATED_MLPS[_name(inner)]
        if "gate_up_proj" in inner:  # phi3 ships it fused
            self.gate_up_proj = inner.pop("gate_up_proj")
            return
        self.gate_up_proj = fuse_linears([inner.gate_proj, inner.up_proj])
        if self.gate_up_proj is not None:  # the separate projections are dropped so weights are not held twice
            for name in ("gate_proj", "up_proj"):
                inner.pop(name)

    def _mlx_activation(self, gate: mx.array, up: mx.array) -> mx.array:
        return mlx_swiglu(gate, up) if self.activation == "silu" else nn.gelu_approx(gate) * up

    def __call__(self, x: mx.array) -> mx.array:
        from metalserve.kernels.cpu.swiglu import gated

        if self.gate_up_proj is None:
            return self.inner(x)
        gate_up = self.gate_up_proj(x)
        if gate_up.dtype != mx.float32:
            gate, up = mx.split(gate_up, 2, axis=-1)
            return self.inner.down_proj(self._mlx_activation(gate, up))
        mx.eval(gate_up)
        hidden = gated(np.asarray(gate_up).reshape(-1, gate_up.shape[-1]), self.activation)
        return self.inner.down_proj(mx.array(hidden).reshape(*x.shape[:-1], -1))
