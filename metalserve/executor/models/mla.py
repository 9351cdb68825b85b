"""Multi-head latent attention (DeepSeek V2/V3 style) over paged latent KV.

Pages hold what mlx-lm's own cache holds, vLLM's MLA layout: per token and layer one "KV head" of width
`kv_lora_rank + qk_rope_head_dim`, the normed compressed latent followed by the roped key. Queries are
absorbed through the kv_b projection's K half (mlx-lm's `embed_q`), so attention runs as MQA over that
one head with V the latent itself (`AttentionOptions.value_dim`); the output, still in latent space, is
un-absorbed per head through the V half (`unembed_out`) before `o_proj`. deepseek_v2's module keeps the
kv_b projection whole; it is split into those two halves at install. Every step, prefill or decode,
takes this one path: the pages never hold per-head K/V (bench/mla_layout.py measures why).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from metalserve.executor.attention.base import AttentionCall, AttentionOptions
from metalserve.executor.context import current_context
from metalserve.executor.models.fused_linear import fuse_linears

_MLA_PARTS = ("kv_a_proj_with_mqa", "kv_a_layernorm", "o_proj", "rope", "kv_lora_rank")


def is_mla_attention(attn: nn.Module) -> bool:
    """An mlx-lm MLA module: absorbed (embed_q / unembed_out: deepseek_v3, glm4_moe_lite) or with kv_b whole."""
    absorbed = hasattr(attn, "embed_q") and hasattr(attn, "unembed_out")
    return all(hasattr(attn, name) for name in _MLA_PARTS) and (absorbed or hasattr(attn, "kv_b_proj"))


def split_kv_b(attn: nn.Module) -> None:
    """Replace `kv_b_proj` `[H * (nope + v), rank]` by mlx-lm's absorbed halves, as its deepseek_v3 does."""
    from mlx_lm.models.mla import MultiLinear

    proj = attn.kv_b_proj
    w = proj.weight
    if isinstance(proj, nn.QuantizedLinear):  # a small matrix: kept exact in the activations' dtype
        w = mx.dequantize(w, proj.scales, proj.biases, proj.group_size, proj.bits)
    heads, nope, rank = attn.num_heads, attn.qk_nope_head_dim, attn.kv_lora_rank
    w = w.reshape(heads, -1, rank)
    attn.embed_q = MultiLinear(nope, rank, heads)
    attn.embed_q.weight = mx.contiguous(w[:, :nope, :].swapaxes(-1, -2))  # [H, rank, nope]
    attn.unembed_out = MultiLinear(rank, w.shape[1] - nope, heads)
    attn.unembed_out.weight = mx.contiguous(w[:, nope:, :])  # [H, v, rank]
    attn.pop("kv_b_proj")


def latent_kv_shape(attn: nn.Module) -> tuple[int, int] | None:
    """(head_dim, value_dim) of the latent pages, `(kv_lora + rope, kv_lora)`; None for other attention."""
    if isinstance(attn, PagedMLA):  # its inner module lost the projections it fused
        return attn.rank + int(attn.inner.qk_rope_head_dim), attn.rank
    if not is_mla_attention(attn):
        return None
    return int(attn.kv_lora_rank) + int(attn.qk_rope_head_dim), int(attn.kv_lora_rank)


class PagedMLA(nn.Module):
    """Replaces one MLA layer's `self_attn`; `mask` and `cache` from the mlx-lm layer are ignored."""

    def __init__(self, inner: nn.Module, layer_idx: int) -> None:
        super().__init__()
        if not hasattr(inner, "embed_q"):
            split_kv_b(inner)
        self.inner = inner
        self.layer_idx = layer_idx
        self.n_heads: int = inner.num_heads
        self.nope: int = inner.qk_nope_head_dim
        self.rank: int = inner.kv_lora_rank
        self.options = AttentionOptions(scale=float(inner.scale), value_dim=self.rank)
        # The query's (first) projection and the latent's read the same x: one matmul for both.
        q_name = "q_proj" if getattr(inner, "q_lora_rank", None) is None else "q_a_proj"
        self.q_width: int = getattr(inner, q_name).weight.shape[0]
        self.q_name = q_name
        self.qkv_a_proj = fuse_linears([getattr(inner, q_name), inner.kv_a_proj_with_mqa])
        if self.qkv_a_proj is not None:
            inner.pop(q_name)
            inner.pop("kv_a_proj_with_mqa")

    def _project(self, x: mx.array, positions: mx.array) -> tuple[mx.array, mx.array]:
        """Absorbed queries `[T, H, rank + rope]` and this step's latent K `[T, 1, rank + rope]`."""
        attn, t, h = self.inner, x.shape[1], self.n_heads
        if self.qkv_a_proj is None:
            q_in, ckv = getattr(attn, self.q_name)(x)[0], attn.kv_a_proj_with_mqa(x)[0]
        else:
            both = self.qkv_a_proj(x)[0]
            q_in, ckv = both[:, : self.q_width], both[:, self.q_width :]
        q = q_in if self.q_name == "q_proj" else attn.q_b_proj(attn.q_a_layernorm(q_in))
        q = q.reshape(t, h, -1)
        latent = attn.kv_a_layernorm(ckv[:, : self.rank])
        # RoPE per token at its own position: each token a batch row `[T, H + 1, 1, rope]`, q and k in one call.
        pe = mx.concatenate([q[:, :, self.nope :], ckv[:, None, self.rank :]], axis=1)
        pe = attn.rope(pe[:, :, None, :], offset=positions)[:, :, 0, :]
        q_latent = attn.embed_q(q[:, :, : self.nope].swapaxes(0, 1)).swapaxes(0, 1)  # [T, H, rank]
        q_full = mx.concatenate([q_latent, pe[:, :h]], axis=-1)
        k = mx.concatenate([latent, pe[:, h]], axis=-1)[:, None, :]
        return q_full, k

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        ctx = current_context()
        t = x.shape[1]
        q, k = self._project(x, ctx.positions)
        call = AttentionCall(q, k, None, ctx.slot_mapping, ctx.kv[self.layer_idx], ctx.metadata, self.options)
        out = ctx.backend.forward(call)  # [T, H, rank]: still in latent space
        heads = self.inner.unembed_out(out.swapaxes(0, 1)).swapaxes(0, 1)  # [T, H, v_head_dim]
        return self.inner.o_proj(heads.reshape(1, t, -1))
