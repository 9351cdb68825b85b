"""The whole decoder on the host, for steps of a few tokens on MLX's CPU backend.

A decode step of the default model ran some ten MLX ops per layer between its host kernels (norms,
residual adds, RoPE, reshapes), each costing 20-90 us of dispatch and a sync: a third of the step at
batch 1. Here every layer runs in one numba call (`kernels/cpu/decoder.py`) over the layers' weights
stacked once: the projections read their packed codes (`kernels/cpu/packed_linear.py`), attention is the CPU path's
kernel on the same pool views. It reads the same weights as the MLX modules and is checked against
mlx-lm's generation token for token.

Only blocks it can reproduce exactly take it (layers.py: llama, qwen2, qwen3, phi3, gemma3 text, every
projection with codes); any other model, or a larger step, runs the MLX modules.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from metalserve.executor.attention.cpu import HostKV, HostQuantKV
from metalserve.executor.context import ForwardContext
from metalserve.executor.host.layers import HostNorm, host_layer, stack, type_name
from metalserve.kernels.cpu.decoder_weights import (
    NO_HOST_LORA,
    DecoderLora,
    DecoderShape,
    DecoderWeights,
    QuantPages,
    no_lora,
)
from metalserve.kernels.cpu.paged import CpuStepPlan
from metalserve.loader.codes_linear import CodesEmbedding, CodesLinear

# Backbones that scale the embedding by sqrt(hidden) (rounded to bfloat16 first, as mlx-lm does).
SCALED_EMBEDDINGS = {"mlx_lm.models.gemma3_text.Gemma3Model"}


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
        embed_scale: float = 1.0,
        layer_kv: tuple[tuple[int, int], ...] = (),
    ) -> None:
        """`layer_kv`: each layer's (pool tensor, group) in the step's context (default: layer i, group 0)."""
        self.embedding = embedding
        self.weights = weights
        self.shape = shape
        self.final_norm = final_norm
        self.codes_only = codes_only
        self.embed_scale = np.float32(embed_scale)
        self.layer_kv = layer_kv or tuple((i, 0) for i in range(weights.input_norm.shape[0]))
        self.lora: DecoderLora = no_lora()  # the adapter slots (lora/fused.py installs them, --enable-lora)

    @staticmethod
    def build(backbone: nn.Module) -> HostForward | None:
        """None unless every block, the embedding and the final norm have host twins of one shape."""
        embed = backbone.embed_tokens
        final_norm = HostNorm.of(backbone.norm)
        dense = type(embed) is nn.Embedding and embed.weight.dtype == mx.float32
        if not (dense or isinstance(embed, CodesEmbedding)) or final_norm is None:
            return None
        layers = [host_layer(block) for block in backbone.layers]
        if not layers or any(layer is None for layer in layers):
            return None
        present = [la for la in layers if la is not None]
        stacked = stack(present)
        if stacked is None:
            return None
        linears = [lin for la in present for lin in (la.qkv, la.o, la.gate_up, la.down)]
        codes_only = all(isinstance(lin.inner, CodesLinear) for lin in linears)
        scale = 1.0
        if type_name(backbone) in SCALED_EMBEDDINGS:
            rounded = mx.array(backbone.args.hidden_size**0.5, mx.bfloat16).astype(mx.float32)
            scale = float(np.asarray(rounded))
        layer_kv = tuple((la.cache_idx, la.group_idx) for la in present)
        table = np.asarray(embed.weight) if dense else embed
        return HostForward(table, *stacked, final_norm, codes_only, scale, layer_kv)

    def applies_to(self, ctx: ForwardContext) -> bool:
        """Whether this step's attention runs on the CPU backend, whose host views this forward writes:
        float pools, or quantized pages of one format throughout (int8, q4, or k8v4's int8 K beside q4 V):
        one numba type for every layer, and the planes' storages alike across layers."""
        if not ctx.kv or not all(isinstance(g.metadata, CpuStepPlan) for g in ctx.groups):
            return False
        if isinstance(ctx.kv[0], HostQuantKV):
            quantized = [kv for kv in ctx.kv if isinstance(kv, HostQuantKV)]
            storages = {(kv.pages.k.storage, kv.pages.v.storage) for kv in quantized}
            return len(quantized) == len(ctx.kv) and len(storages) == 1
        return all(isinstance(kv, HostKV) for kv in ctx.kv)

    def embed(self, token_ids: np.ndarray) -> np.ndarray:
        table = self.embedding
        rows = table[token_ids] if isinstance(table, np.ndarray) else table.lookup(token_ids)
        if self.embed_scale != 1:
            rows *= self.embed_scale
        return rows

    def __call__(self, token_ids: np.ndarray, ctx: ForwardContext) -> np.ndarray:
        """`[T]` token ids -> the final-normed hidden states `[T, hidden]` float32."""
        from metalserve.kernels.cpu.decoder import decoder_layers

        kv = [ctx.kv[tensor] for tensor, _ in self.layer_kv]
        pools: tuple[np.ndarray, ...] | tuple[QuantPages, ...]
        if isinstance(kv[0], HostQuantKV):
            pools = tuple(c.pages for c in kv if isinstance(c, HostQuantKV))
        else:
            pools = tuple(c.host for c in kv if isinstance(c, HostKV))
        plans = tuple(ctx.groups[group].metadata for _, group in self.layer_kv)
        step = ctx.lora.host if ctx.lora is not None else NO_HOST_LORA
        h = decoder_layers(self.embed(token_ids), self.weights, self.shape, pools, plans, self.lora, step)
        return self.final_norm(h)
