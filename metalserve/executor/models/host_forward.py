"""The whole decoder on the host, for steps of a few tokens on MLX's CPU backend.

A decode step of the default model ran some ten MLX ops per layer between its host kernels (norms,
residual adds, RoPE, reshapes), each costing 20-90 us of dispatch and a sync: a third of the step at
batch 1. Here the same layer runs as NumPy arrays through numba kernels: the projections read their
stored codes (`cpu_affine_linear`), attention is the CPU path's kernel on the same pool views. It reads
the same weights as the MLX modules and is checked against mlx-lm's generation token for token.

Only llama-family blocks it can reproduce exactly take it (pre-norm RMSNorm, plain RoPE, SwiGLU, every
projection with codes); any other model, or a larger step, runs the MLX modules as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from metalserve.executor.context import ForwardContext, PortableKV
from metalserve.executor.models.host_linear import HostLinear
from metalserve.executor.models.host_mlp import HostSwiGLUMLP
from metalserve.executor.models.paged_attention import PagedAttention
from metalserve.kernels.reference import AttentionOptions

# The decoder blocks whose __call__ is `h = x + attn(norm1(x)); out = h + mlp(norm2(h))`.
PRE_NORM_BLOCKS = {
    "mlx_lm.models.llama.TransformerBlock",
    "mlx_lm.models.qwen2.TransformerBlock",
    "mlx_lm.models.qwen3.TransformerBlock",
}


@dataclass(frozen=True)
class HostNorm:
    weight: np.ndarray
    eps: float

    @staticmethod
    def of(norm: nn.Module) -> HostNorm | None:
        if type(norm) is not nn.RMSNorm or norm.weight.dtype != mx.float32:
            return None
        return HostNorm(np.asarray(norm.weight), float(norm.eps))

    def __call__(self, x: np.ndarray) -> np.ndarray:
        from metalserve.kernels.cpu_layer_ops import rms_norm

        return rms_norm(x, self.weight, self.eps)


@dataclass(frozen=True)
class HostLayer:
    index: int
    input_norm: HostNorm
    post_attention_norm: HostNorm
    qkv: HostLinear  # called through `.host`, on NumPy arrays
    o: HostLinear
    gate_up: HostLinear
    down: HostLinear
    q_norm: HostNorm | None  # qwen3's per-head norms before RoPE
    k_norm: HostNorm | None
    n_heads: int
    n_kv_heads: int
    rope_dims: int
    rope_inv_freq: np.ndarray
    rope_scale: float
    options: AttentionOptions


def _host_layer(index: int, block: nn.Module) -> HostLayer | None:
    """The host twin of one decoder block, or None if the host forward cannot reproduce it."""
    if f"{type(block).__module__}.{type(block).__qualname__}" not in PRE_NORM_BLOCKS:
        return None
    attn, mlp = block.self_attn, block.mlp
    if not isinstance(attn, PagedAttention) or not isinstance(mlp, HostSwiGLUMLP):
        return None
    qkv, o, gate_up, down = [attn.qkv_proj, attn.inner.o_proj, mlp.gate_up_proj, mlp.inner.down_proj]
    rope = attn.inner.rope
    if not (isinstance(qkv, HostLinear) and isinstance(o, HostLinear)):
        return None
    if not (isinstance(gate_up, HostLinear) and isinstance(down, HostLinear)):
        return None
    if type(rope) is not nn.RoPE or rope.traditional:
        return None
    norms = [HostNorm.of(block.input_layernorm), HostNorm.of(block.post_attention_layernorm)]
    head_norms = [HostNorm.of(attn.inner.q_norm), HostNorm.of(attn.inner.k_norm)] if attn.per_head_norms else []
    input_norm, post_norm = norms
    if input_norm is None or post_norm is None or None in head_norms:
        return None
    from metalserve.kernels.cpu_layer_ops import rope_inverse_frequencies

    return HostLayer(
        index=index, input_norm=input_norm, post_attention_norm=post_norm, qkv=qkv, o=o, gate_up=gate_up,
        down=down, q_norm=head_norms[0] if head_norms else None, k_norm=head_norms[1] if head_norms else None,
        n_heads=attn.n_heads, n_kv_heads=attn.n_kv_heads, rope_dims=int(rope.dims),
        rope_inv_freq=rope_inverse_frequencies(int(rope.dims), float(rope.base)), rope_scale=float(rope.scale),
        options=attn.options,
    )  # fmt: skip


class HostForward:
    """`hidden_states` of a `PagedModel` computed on the host; build it with `HostForward.build`."""

    def __init__(self, embedding: np.ndarray, layers: list[HostLayer], final_norm: HostNorm) -> None:
        self.embedding = embedding
        self.layers = layers
        self.final_norm = final_norm

    @staticmethod
    def build(backbone: nn.Module) -> HostForward | None:
        """None unless every block, the embedding and the final norm have host twins."""
        embed = backbone.embed_tokens
        final_norm = HostNorm.of(backbone.norm)
        if type(embed) is not nn.Embedding or embed.weight.dtype != mx.float32 or final_norm is None:
            return None
        layers = [_host_layer(i, block) for i, block in enumerate(backbone.layers)]
        if any(layer is None for layer in layers):
            return None
        return HostForward(np.asarray(embed.weight), [la for la in layers if la is not None], final_norm)

    def applies_to(self, ctx: ForwardContext) -> bool:
        """Whether this step's attention runs on the CPU path, where this forward can write the pools."""
        return ctx.cpu is not None and all(isinstance(kv, PortableKV) and kv.host is not None for kv in ctx.kv)

    def __call__(self, token_ids: np.ndarray, ctx: ForwardContext) -> np.ndarray:
        """`[T]` token ids -> the final-normed hidden states `[T, hidden]` float32."""
        h = self.embedding[token_ids]
        for layer in self.layers:
            h = h + self._attention(layer, layer.input_norm(h), ctx)
            h = h + self._mlp(layer, layer.post_attention_norm(h))
        return self.final_norm(h)

    @staticmethod
    def _attention(layer: HostLayer, x: np.ndarray, ctx: ForwardContext) -> np.ndarray:
        from metalserve.kernels.cpu import attend_on_host
        from metalserve.kernels.cpu_layer_ops import rope_in_place

        assert ctx.cpu is not None
        tokens, hq, hkv = x.shape[0], layer.n_heads, layer.n_kv_heads
        qkv = layer.qkv.host(x).reshape(tokens, hq + 2 * hkv, -1)
        q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
        if layer.q_norm is not None and layer.k_norm is not None:
            q, k = layer.q_norm(q), layer.k_norm(k)
        q, k = np.ascontiguousarray(q), np.ascontiguousarray(k)
        rope_in_place(q, ctx.cpu.row_pos, layer.rope_inv_freq, layer.rope_scale)
        rope_in_place(k, ctx.cpu.row_pos, layer.rope_inv_freq, layer.rope_scale)
        kv = ctx.kv[layer.index]
        assert isinstance(kv, PortableKV) and kv.host is not None
        out = attend_on_host(q, k, v, kv.host, ctx.cpu, layer.options)
        return layer.o.host(out.reshape(tokens, -1))

    @staticmethod
    def _mlp(layer: HostLayer, x: np.ndarray) -> np.ndarray:
        from metalserve.kernels.cpu_swiglu import swiglu

        return layer.down.host(swiglu(layer.gate_up.host(x)))
