"""The whole decoder on the host, for steps of a few tokens on MLX's CPU backend.

A decode step of the default model ran some ten MLX ops per layer between its host kernels (norms,
residual adds, RoPE, reshapes), each costing 20-90 us of dispatch and a sync: a third of the step at
batch 1. Here every layer runs in one numba call (`kernels/cpu/decoder.py`) over the layers' weights
stacked once: the projections read their packed codes (`kernels/cpu/packed_linear.py`), attention is the CPU path's
kernel on the same pool views. It reads the same weights as the MLX modules and is checked against
mlx-lm's generation token for token.

Only llama-family blocks it can reproduce exactly take it (pre-norm RMSNorm, plain RoPE, SwiGLU, every
projection with codes); any other model, or a larger step, runs the MLX modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from metalserve.executor.attention.base import AttentionOptions
from metalserve.executor.attention.cpu import HostKV
from metalserve.executor.context import ForwardContext
from metalserve.executor.host.linear import HostLinear
from metalserve.executor.host.mlp import HostSwiGLUMLP
from metalserve.executor.models.paged_attention import PagedAttention
from metalserve.kernels.cpu.decoder_weights import NO_HOST_LORA, DecoderLora, DecoderShape, DecoderWeights, no_lora
from metalserve.loader.codes_linear import CodesEmbedding, CodesLinear

if TYPE_CHECKING:
    from metalserve.kernels.cpu.packed_linear import Segments
from metalserve.kernels.cpu.paged import CpuStepPlan

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
        from metalserve.kernels.cpu.layer_ops import rms_norm

        return rms_norm(x, self.weight, self.eps)


@dataclass(frozen=True)
class HostLayer:
    """What one block needs on the host; `_stack` stacks these into the one-call decoder's weights."""

    input_norm: HostNorm
    post_attention_norm: HostNorm
    qkv: HostLinear
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


def _host_layer(block: nn.Module) -> HostLayer | None:
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
    from metalserve.kernels.cpu.layer_ops import rope_inverse_frequencies

    return HostLayer(
        input_norm=input_norm,
        post_attention_norm=post_norm,
        qkv=qkv,
        o=o,
        gate_up=gate_up,
        down=down,
        q_norm=head_norms[0] if head_norms else None,
        k_norm=head_norms[1] if head_norms else None,
        n_heads=attn.n_heads,
        n_kv_heads=attn.n_kv_heads,
        rope_dims=int(rope.dims),
        rope_inv_freq=rope_inverse_frequencies(int(rope.dims), float(rope.base)),
        rope_scale=float(rope.scale),
        options=attn.options,
    )


def _stacked_linear(linears: list[HostLinear]) -> Segments | None:
    """One projection of every layer as the kernel's segments (views of the layers' codes, not copies).
    None if the layers' widths or output sizes differ."""
    if len({(sum(p.shape[0] for p in lin.codes), lin.codes[0].columns) for lin in linears}) != 1:
        return None
    from metalserve.kernels.cpu.packed_linear import segments_of

    rows = sum(p.shape[0] for p in linears[0].codes)
    zeros = np.zeros(rows, np.float32)
    bias = np.stack([np.asarray(lin.inner.bias) if "bias" in lin.inner else zeros for lin in linears])
    return segments_of([list(lin.codes) for lin in linears], bias.astype(np.float32))


def _stack(layers: list[HostLayer]) -> tuple[DecoderWeights, DecoderShape] | None:
    """The layers as one `DecoderWeights`, or None unless every layer has the same shapes and options."""
    first = layers[0]
    same = {
        (
            la.n_heads,
            la.n_kv_heads,
            la.rope_dims,
            la.rope_scale,
            la.input_norm.eps,
            la.post_attention_norm.eps,
            la.q_norm is None,
            la.q_norm.eps if la.q_norm else 0.0,
            la.k_norm.eps if la.k_norm else 0.0,
            la.options.scale,
            la.options.softcap,
            la.options.sinks is None,
            la.rope_inv_freq.tobytes(),
        )
        for la in layers
    }
    if len(same) != 1 or first.options.sinks is not None or first.input_norm.eps != first.post_attention_norm.eps:
        return None
    linears = [_stacked_linear([getattr(la, name) for la in layers]) for name in ("qkv", "o", "gate_up", "down")]
    qkv, o, gate_up, down = linears
    if qkv is None or o is None or gate_up is None or down is None:
        return None
    head_dim = qkv.bias.shape[1] // (first.n_heads + 2 * first.n_kv_heads)
    ones = np.ones((len(layers), head_dim), np.float32)
    weights = DecoderWeights(
        input_norm=np.stack([la.input_norm.weight for la in layers]),
        post_attention_norm=np.stack([la.post_attention_norm.weight for la in layers]),
        qkv=qkv,
        o=o,
        gate_up=gate_up,
        down=down,
        q_norm=np.stack([la.q_norm.weight for la in layers if la.q_norm]) if first.q_norm else ones,
        k_norm=np.stack([la.k_norm.weight for la in layers if la.k_norm]) if first.k_norm else ones,
        rope_inv_freq=first.rope_inv_freq,
        sliding_windows=np.array([la.options.sliding_window or 0 for la in layers], np.int64),
    )
    shape = DecoderShape(
        n_heads=first.n_heads,
        n_kv_heads=first.n_kv_heads,
        head_dim=head_dim,
        head_norms=first.q_norm is not None,
        norm_eps=first.input_norm.eps,
        head_norm_eps=first.q_norm.eps if first.q_norm else 0.0,
        rope_scale=first.rope_scale,
        attention_scale=first.options.scale,
        softcap=first.options.softcap or 0.0,
    )
    return weights, shape


class HostForward:
    """`hidden_states` of a `PagedModel` computed on the host; build it with `HostForward.build`.

    `embedding`: a dense float32 table or the table's codes. `codes_only`: no projection has an fp32
    copy, so every step, however long, runs here (the MLX modules would read the same codes, slower)."""

    def __init__(
        self,
        embedding: np.ndarray | CodesEmbedding,
        weights: DecoderWeights,
        shape: DecoderShape,
        final_norm: HostNorm,
        codes_only: bool = False,
    ) -> None:
        self.embedding = embedding
        self.weights = weights
        self.shape = shape
        self.final_norm = final_norm
        self.codes_only = codes_only
        self.lora: DecoderLora = no_lora()  # the adapter slots (lora/fused.py installs them, --enable-lora)

    @staticmethod
    def build(backbone: nn.Module) -> HostForward | None:
        """None unless every block, the embedding and the final norm have host twins of one shape."""
        embed = backbone.embed_tokens
        final_norm = HostNorm.of(backbone.norm)
        dense = type(embed) is nn.Embedding and embed.weight.dtype == mx.float32
        if not (dense or isinstance(embed, CodesEmbedding)) or final_norm is None:
            return None
        layers = [_host_layer(block) for block in backbone.layers]
        if not layers or any(layer is None for layer in layers):
            return None
        present = [la for la in layers if la is not None]
        stacked = _stack(present)
        if stacked is None:
            return None
        linears = [lin for la in present for lin in (la.qkv, la.o, la.gate_up, la.down)]
        codes_only = all(isinstance(lin.inner, CodesLinear) for lin in linears)
        return HostForward(np.asarray(embed.weight) if dense else embed, *stacked, final_norm, codes_only)

    def applies_to(self, ctx: ForwardContext) -> bool:
        """Whether this step's attention runs on the CPU backend, whose host views this forward writes."""
        one_group = len(ctx.groups) == 1  # one table: the decoder reads every layer's pool through it
        return one_group and isinstance(ctx.metadata, CpuStepPlan) and all(isinstance(kv, HostKV) for kv in ctx.kv)

    def embed(self, token_ids: np.ndarray) -> np.ndarray:
        if isinstance(self.embedding, np.ndarray):
            return self.embedding[token_ids]
        from metalserve.kernels.cpu.packed_linear import gather_rows

        return gather_rows(self.embedding.codes, token_ids)

    def __call__(self, token_ids: np.ndarray, ctx: ForwardContext) -> np.ndarray:
        """`[T]` token ids -> the final-normed hidden states `[T, hidden]` float32."""
        from metalserve.kernels.cpu.decoder import decoder_layers

        pools = tuple(kv.host for kv in ctx.kv)
        step = ctx.lora.host if ctx.lora is not None else NO_HOST_LORA
        h = decoder_layers(self.embed(token_ids), self.weights, self.shape, pools, ctx.metadata, self.lora, step)
        return self.final_norm(h)
