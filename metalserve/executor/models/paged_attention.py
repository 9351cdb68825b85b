"""Our attention layer: mlx-lm's projections, norms and RoPE, with K/V kept in paged pools.

It takes over an mlx-lm attention module's weights, so every token-wise layer around it stays mlx-lm's.
The packed batch arrives as one sequence `[1, T, hidden]`; RoPE runs per token at its own position.
What differs between families (head counts, scale, window, sinks, softcap) is read once by
`attention_traits`; how the module projects is read here: fused or separate q/k/v, k used as v
(gemma4's full layers), q/k norms per head (qwen3, gemma) or over the whole projection (olmo2), a
norm on v (gemma4), and no k/v at all for a layer that reads an earlier layer's K/V (gemma4).
"""

from __future__ import annotations

import inspect
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from metalserve.executor.attention.base import AttentionCall, AttentionOptions
from metalserve.executor.context import current_context
from metalserve.executor.models.attention_traits import AttentionTraits
from metalserve.executor.models.fused_linear import fuse_linears

# Flags some backbones read off the attention module to pick a layer's mask (exaone4: `is_local`).
_FLAGS_BACKBONES_READ = ("is_local", "is_sliding", "use_sliding_window")


def _norm_mode(inner: nn.Module, head_dim: int) -> str | None:
    """ "head": q/k norms over each head (before RoPE); "full": over the whole projection; None: no norms."""
    if "q_norm" not in inner:
        return None
    weight = getattr(inner.q_norm, "weight", None)
    return "full" if weight is not None and weight.shape[-1] != head_dim else "head"


class PagedAttention(nn.Module):
    """Replaces one layer's `self_attn`; `mask` and `cache` from the mlx-lm layer are ignored (and so is
    ministral3's batch-wide query scale, passed where others pass the mask: we scale per token)."""

    def __init__(self, inner: nn.Module, traits: AttentionTraits, cache_idx: int, group_idx: int = 0) -> None:
        """`cache_idx`: the pool tensor this layer uses; `group_idx`: the layer group whose table it reads."""
        super().__init__()
        self.inner = inner
        self.layer_idx = traits.layer
        self.cache_idx = cache_idx
        self.group_idx = group_idx
        self.n_heads, self.n_kv_heads, self.head_dim = traits.n_heads, traits.n_kv_heads, traits.head_dim
        sinks = inner.sinks if traits.has_sinks else None
        self.options = AttentionOptions(traits.scale, traits.window, traits.softcap, sinks)
        self.position_scale = traits.position_scale
        self.rotary = traits.rotary
        self.reads_shared = traits.kv_source != traits.layer
        # gemma4's attention returns (output, (k, v), offset) and takes the shared K/V as a keyword.
        self.returns_kv = "shared_kv" in inspect.signature(type(inner).__call__).parameters
        self.norms = _norm_mode(inner, self.head_dim)
        self.per_head_norms = self.norms == "head"  # the host forward reads this (qwen3's norms)
        self.qkv_proj = self._fused_projection(inner)
        for name in _FLAGS_BACKBONES_READ:
            if hasattr(inner, name):
                setattr(self, name, getattr(inner, name))

    def _fused_projection(self, inner: nn.Module) -> nn.Module | None:
        """One matmul for q, k and v where the module has all three (phi3 ships it fused); the separate
        projections are dropped so weights are not held twice."""
        if "qkv_proj" in inner:
            return inner.pop("qkv_proj")
        if self.reads_shared or not all(name in inner for name in ("q_proj", "k_proj", "v_proj")):
            return None
        fused = fuse_linears([inner.q_proj, inner.k_proj, inner.v_proj])
        if fused is not None:
            for name in ("q_proj", "k_proj", "v_proj"):
                inner.pop(name)
        return fused

    def _linear(self, x: mx.array) -> tuple[mx.array, mx.array | None, mx.array | None]:
        """q `[T, Hq * D]`, k and v `[T, Hkv * D]` (None for a shared-KV layer)."""
        attn, hq, hkv, d = self.inner, self.n_heads, self.n_kv_heads, self.head_dim
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x)[0]
            return qkv[:, : hq * d], qkv[:, hq * d : (hq + hkv) * d], qkv[:, (hq + hkv) * d :]
        q = attn.q_proj(x)[0]
        if self.reads_shared:
            return q, None, None
        k = attn.k_proj(x)[0]
        return q, k, attn.v_proj(x)[0] if "v_proj" in attn else k  # gemma4's full layers: v is k

    def _project(self, x: mx.array, positions: mx.array) -> tuple[mx.array, mx.array | None, mx.array | None]:
        """q [T, Hq, D], k and v [T, Hkv, D], with RoPE applied per token at its position."""
        attn, t, hq, hkv = self.inner, x.shape[1], self.n_heads, self.n_kv_heads
        if self.rotary and self.qkv_proj is not None and self.norms is None and "v_norm" not in attn:
            # The common case: q and k rotated straight from the fused output's heads, no copy.
            qkv = self.qkv_proj(x).reshape(t, hq + 2 * hkv, -1)
            qk = attn.rope(qkv[:, : hq + hkv, None, :], offset=positions)[:, :, 0, :]
            return qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv :]
        q, k, v = self._linear(x)
        if self.norms == "full":
            q, k = attn.q_norm(q), attn.k_norm(k) if k is not None else None
        q = q.reshape(t, hq, -1)
        k = k.reshape(t, hkv, -1) if k is not None else None
        v = v.reshape(t, hkv, -1) if v is not None else None
        if self.norms == "head":
            q, k = attn.q_norm(q), attn.k_norm(k) if k is not None else None
        if v is not None and "v_norm" in attn:
            v = attn.v_norm(v)
        if not self.rotary:
            return q, k, v
        # RoPE sees each token as its own batch row with its own offset: [T, H, 1, D]; q and k in one call.
        if k is None:
            return attn.rope(q[:, :, None, :], offset=positions)[:, :, 0, :], None, None
        qk = attn.rope(mx.concatenate([q, k], axis=1)[:, :, None, :], offset=positions)[:, :, 0, :]
        return qk[:, :hq], qk[:, hq:], v

    def __call__(
        self, x: mx.array, mask: Any = None, cache: Any = None, shared_kv: Any = None, offset: Any = None
    ) -> Any:
        ctx = current_context()
        t = x.shape[1]
        q, k, v = self._project(x, ctx.positions)
        if self.position_scale is not None:  # after RoPE, per token at its own position (not the batch's)
            beta, original = self.position_scale
            scale = 1 + beta * mx.log(1 + mx.floor(ctx.positions / original))
            q = q * scale.astype(q.dtype)[:, None, None]
        if self.reads_shared:
            # The source layer's K/V of this step: written again to the same slots (the same values),
            # so every backend's write-then-attend call serves a layer that only reads.
            k, v = shared_kv
        assert k is not None and v is not None
        group = ctx.groups[self.group_idx]
        call = AttentionCall(q, k, v, group.slot_mapping, ctx.kv[self.cache_idx], group.metadata, self.options)
        out = self.inner.o_proj(ctx.backend.forward(call).reshape(1, t, -1))
        return (out, (k, v), None) if self.returns_kv else out
