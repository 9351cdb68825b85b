"""The attention layers of the hybrid families, over the paged KV pools.

They differ from llama's in small ways this one module reads off the mlx-lm module: a query
projection twice as wide whose second half gates the output (qwen3_next, qwen3_5), per-head norms
under either name, partial rotary (mlx-lm's RoPE object rotates its own dims), no RoPE at all
(nemotron_h, granitemoehybrid), Granite's own attention multiplier as the scale, and `out_proj` for
`o_proj` (lfm2). The generic adapter of the attention families may take this over once it reads the
same module features.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from metalserve.executor.attention.base import AttentionCall, AttentionOptions
from metalserve.executor.context import current_context


def _first_attr(module: Any, names: tuple[str, ...]) -> str | None:
    return next((n for n in names if hasattr(module, n)), None)


def _count(module: Any, names: tuple[str, ...]) -> int:
    name = _first_attr(module, names)
    if name is None:
        raise ValueError(f"{type(module).__name__} has none of {names}: not an attention module we know")
    return int(getattr(module, name))


class HybridAttention(nn.Module):
    """Replaces one layer's attention module; `kv_idx`: its place among the model's attention layers."""

    def __init__(self, inner: nn.Module, kv_idx: int) -> None:
        super().__init__()
        self.inner = inner
        self.kv_idx = kv_idx
        self.n_heads = _count(inner, ("n_heads", "num_attention_heads", "num_heads"))
        self.n_kv_heads = _count(inner, ("n_kv_heads", "num_key_value_heads"))
        self.head_dim = int(inner.k_proj.weight.shape[0]) // self.n_kv_heads
        self.gated = int(inner.q_proj.weight.shape[0]) == 2 * self.n_heads * self.head_dim
        self.q_norm = _first_attr(inner, ("q_norm", "q_layernorm"))
        self.k_norm = _first_attr(inner, ("k_norm", "k_layernorm"))
        self.out = _first_attr(inner, ("o_proj", "out_proj")) or "o_proj"
        self.has_rope = getattr(inner, "rope", None) is not None  # Granite 4.0-H, nemotron_h: NoPE
        self.options = AttentionOptions(scale=float(inner.scale))

    def _project(self, x: mx.array, positions: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array | None]:
        """q [T, Hq, D], k and v [T, Hkv, D] (RoPE at each token's position), and the output gate."""
        attn, t, hq = self.inner, x.shape[1], self.n_heads
        q = attn.q_proj(x).reshape(t, hq, -1)
        gate = None
        if self.gated:  # per head: the query, then its gate
            q, gate = q[..., : self.head_dim], q[..., self.head_dim :].reshape(1, t, -1)
        k = attn.k_proj(x).reshape(t, self.n_kv_heads, -1)
        v = attn.v_proj(x).reshape(t, self.n_kv_heads, -1)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = getattr(attn, self.q_norm)(q), getattr(attn, self.k_norm)(k)
        if self.has_rope:  # each token its own batch row at its own offset: [T, H, 1, D]
            qk = attn.rope(mx.concatenate([q, k], axis=1)[:, :, None, :], offset=positions)[:, :, 0, :]
            q, k = qk[:, :hq], qk[:, hq:]
        return q, k, v, gate

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        ctx = current_context()
        t = x.shape[1]
        q, k, v, gate = self._project(x, ctx.positions)
        call = AttentionCall(q, k, v, ctx.slot_mapping, ctx.kv[self.kv_idx], ctx.metadata, self.options)
        out = ctx.backend.forward(call).reshape(1, t, -1)
        if gate is not None:
            out = out * mx.sigmoid(gate)
        return getattr(self.inner, self.out)(out)
