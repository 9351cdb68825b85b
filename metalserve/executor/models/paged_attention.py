"""Our attention layer: mlx-lm's projections, norms and RoPE, with K/V kept in paged pools.

It takes over an mlx-lm attention module's weights, so every token-wise layer around it stays mlx-lm's.
The packed batch arrives as one sequence `[1, T, hidden]`; RoPE runs per token at its own position.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from metalserve.executor.attention.base import AttentionCall
from metalserve.executor.context import current_context
from metalserve.executor.models.fused_linear import fuse_linears
from metalserve.kernels.reference import AttentionOptions


class PagedAttention(nn.Module):
    """Replaces one layer's `self_attn`; `mask` and `cache` from the mlx-lm layer are ignored."""

    def __init__(self, inner: nn.Module, layer_idx: int, sliding_window: int | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.layer_idx = layer_idx
        self.n_heads: int = inner.n_heads
        self.n_kv_heads: int = inner.n_kv_heads
        self.options = AttentionOptions(scale=float(inner.scale), sliding_window=sliding_window)
        # One matmul for q, k and v; the separate projections are dropped so weights are not held twice.
        self.qkv_proj = fuse_linears([inner.q_proj, inner.k_proj, inner.v_proj])
        if self.qkv_proj is not None:
            for name in ("q_proj", "k_proj", "v_proj"):
                inner.pop(name)
        self.per_head_norms = hasattr(inner, "q_norm")  # qwen3: norms on q and k before RoPE

    def _project(self, x: mx.array, positions: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """q [T, Hq, D], k and v [T, Hkv, D], with RoPE applied per token at its position."""
        attn, t, hq, hkv = self.inner, x.shape[1], self.n_heads, self.n_kv_heads
        if self.qkv_proj is None:
            q = attn.q_proj(x).reshape(t, hq, -1)
            k = attn.k_proj(x).reshape(t, hkv, -1)
            v = attn.v_proj(x).reshape(t, hkv, -1)
        else:
            qkv = self.qkv_proj(x).reshape(t, hq + 2 * hkv, -1)
            q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
        if self.per_head_norms:
            q, k = attn.q_norm(q), attn.k_norm(k)
        # RoPE sees each token as its own batch row with its own offset: [T, H, 1, D]; q and k in one call.
        qk = mx.concatenate([q, k], axis=1) if self.per_head_norms or self.qkv_proj is None else qkv[:, : hq + hkv]
        qk = attn.rope(qk[:, :, None, :], offset=positions)[:, :, 0, :]
        return qk[:, :hq], qk[:, hq:], v

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        ctx = current_context()
        t = x.shape[1]
        q, k, v = self._project(x, ctx.positions)
        call = AttentionCall(q, k, v, ctx.slot_mapping, ctx.kv[self.layer_idx], ctx.metadata, self.options)
        out = ctx.backend.forward(call)
        return self.inner.o_proj(out.reshape(1, t, -1))
