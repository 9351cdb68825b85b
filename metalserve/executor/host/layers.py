"""The host twins of mlx-lm's decoder blocks, and their stacking into the one-call decoder's weights.

A block has a twin when the host decoder (kernels/cpu/decoder.py) reproduces it exactly: RMSNorm
(gemma3's `1 + weight` folded in once), RoPE (plain, linear-scaled, or phi3's SuScaledRoPE as its
frequencies and input factor), q/k norms per head, a gated MLP (SwiGLU, or gemma3's GELU-tanh) and every
projection with codes; pre-norm blocks (llama, qwen2, qwen3, phi3) or gemma3's sandwich (each
sub-block's output normed before its residual add).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.rope_utils import SuScaledRoPE

from metalserve.executor.attention.base import AttentionOptions
from metalserve.executor.host.linear import HostLinear
from metalserve.executor.host.mlp import HostGatedMLP
from metalserve.executor.models.paged_attention import PagedAttention
from metalserve.kernels.cpu.decoder_weights import DecoderShape, DecoderWeights
from metalserve.kernels.cpu.packed_linear import Segments

# The decoder blocks whose __call__ is `h = x + attn(norm1(x)); out = h + mlp(norm2(h))`.
PRE_NORM_BLOCKS = {
    "mlx_lm.models.llama.TransformerBlock",
    "mlx_lm.models.qwen2.TransformerBlock",
    "mlx_lm.models.qwen3.TransformerBlock",
    "mlx_lm.models.phi3.TransformerBlock",
}
# `h = x + norm2(attn(norm1(x))); out = h + norm4(mlp(norm3(h)))` (float32: clip_residual is a plain add).
SANDWICH_BLOCKS = {"mlx_lm.models.gemma3_text.TransformerBlock"}
# RMSNorms that scale by `1 + weight`.
OFFSET_NORMS = {"mlx_lm.models.gemma3_text.RMSNorm"}


def type_name(module: object) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


@dataclass(frozen=True)
class HostNorm:
    weight: np.ndarray  # what multiplies the normed row (gemma3's `1 + weight`, as MLX adds it, in float32)
    eps: float

    @staticmethod
    def of(norm: nn.Module) -> HostNorm | None:
        offset = type_name(norm) in OFFSET_NORMS
        if not (type(norm) is nn.RMSNorm or offset) or norm.weight.dtype != mx.float32:
            return None
        weight = np.asarray(1.0 + norm.weight if offset else norm.weight)
        return HostNorm(weight, float(norm.eps))

    def __call__(self, x: np.ndarray) -> np.ndarray:
        from metalserve.kernels.cpu.layer_ops import rms_norm

        return rms_norm(x, self.weight, self.eps)


@dataclass(frozen=True)
class HostRope:
    """Non-traditional RoPE over the first `2 * len(inv_freq)` features: angle `pos * scale * inv_freq[i]`,
    the rotated features first multiplied by `mscale`."""

    inv_freq: np.ndarray
    scale: float
    mscale: float

    @staticmethod
    def of(rope: nn.Module) -> HostRope | None:
        from metalserve.kernels.cpu.layer_ops import rope_inverse_frequencies

        if type(rope) is nn.RoPE and not rope.traditional:
            return HostRope(rope_inverse_frequencies(int(rope.dims), float(rope.base)), float(rope.scale), 1.0)
        if type(rope) is SuScaledRoPE:  # mx.fast.rope with `freqs`: angle pos / freqs[i]
            inv_freq = (np.float32(1.0) / np.asarray(rope._freqs, np.float32)).astype(np.float32)
            return HostRope(inv_freq, 1.0, float(rope._scale))
        return None

    def key(self) -> tuple[float, float, bytes]:
        return self.scale, self.mscale, self.inv_freq.tobytes()


@dataclass(frozen=True)
class HostLayer:
    """What one block needs on the host; `stack` stacks these into the one-call decoder's weights."""

    input_norm: HostNorm
    post_attention_norm: HostNorm  # before the MLP
    attn_out_norm: HostNorm | None  # gemma3's norms of the sub-blocks' outputs
    mlp_out_norm: HostNorm | None
    qkv: HostLinear
    o: HostLinear
    gate_up: HostLinear
    down: HostLinear
    activation: str
    q_norm: HostNorm | None  # qwen3's and gemma3's per-head norms before RoPE
    k_norm: HostNorm | None
    n_heads: int
    n_kv_heads: int
    rope: HostRope
    options: AttentionOptions
    cache_idx: int  # the pool tensor and the group (block table) of this layer's K/V
    group_idx: int


def _norms(block: nn.Module, sandwich: bool) -> list[HostNorm | None]:
    """(input, before the MLP, after attention, after the MLP); a missing one is None."""
    if not sandwich:
        return [HostNorm.of(block.input_layernorm), HostNorm.of(block.post_attention_layernorm)]
    names = ("input_layernorm", "pre_feedforward_layernorm", "post_attention_layernorm", "post_feedforward_layernorm")
    return [HostNorm.of(getattr(block, name)) for name in names]


def host_layer(block: nn.Module) -> HostLayer | None:
    """The host twin of one decoder block, or None if the host forward cannot reproduce it."""
    sandwich = type_name(block) in SANDWICH_BLOCKS
    if type_name(block) not in PRE_NORM_BLOCKS and not sandwich:
        return None
    attn, mlp = block.self_attn, block.mlp
    if not isinstance(attn, PagedAttention) or not isinstance(mlp, HostGatedMLP) or attn.position_scale:
        return None
    qkv, o, gate_up, down = [attn.qkv_proj, attn.inner.o_proj, mlp.gate_up_proj, mlp.inner.down_proj]
    if not (isinstance(qkv, HostLinear) and isinstance(o, HostLinear)):
        return None
    if not (isinstance(gate_up, HostLinear) and isinstance(down, HostLinear)):
        return None
    rope = HostRope.of(attn.inner.rope)
    norms = _norms(block, sandwich)
    head_norms = [HostNorm.of(attn.inner.q_norm), HostNorm.of(attn.inner.k_norm)] if attn.per_head_norms else []
    if rope is None or attn.norms == "full" or None in norms or None in head_norms or "v_norm" in attn.inner:
        return None
    input_norm, post_norm = norms[0], norms[1]
    assert input_norm is not None and post_norm is not None
    return HostLayer(
        input_norm=input_norm,
        post_attention_norm=post_norm,
        attn_out_norm=norms[2] if sandwich else None,
        mlp_out_norm=norms[3] if sandwich else None,
        qkv=qkv,
        o=o,
        gate_up=gate_up,
        down=down,
        activation=mlp.activation,
        q_norm=head_norms[0] if head_norms else None,
        k_norm=head_norms[1] if head_norms else None,
        n_heads=attn.n_heads,
        n_kv_heads=attn.n_kv_heads,
        rope=rope,
        options=attn.options,
        cache_idx=attn.cache_idx,
        group_idx=attn.group_idx,
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


def _same_shape(la: HostLayer) -> tuple[object, ...]:
    """What every layer must share (RoPE, window and the norms' weights may differ by layer)."""
    norms = [la.input_norm, la.post_attention_norm, la.attn_out_norm, la.mlp_out_norm, la.q_norm, la.k_norm]
    rope_dims = len(la.rope.inv_freq)
    return (
        la.n_heads,
        la.n_kv_heads,
        rope_dims,
        la.activation,
        tuple(None if n is None else n.eps for n in norms),
        la.options.scale,
        la.options.softcap,
        la.options.sinks is None,
    )


def _stack_norms(norms: list[HostNorm | None], width: int) -> np.ndarray:
    """`[L, width]`: each layer's weight, or ones where the layers have none (unread then)."""
    if norms[0] is None:
        return np.ones((len(norms), width), np.float32)
    return np.stack([n.weight for n in norms if n is not None]).astype(np.float32)


def stack(layers: list[HostLayer]) -> tuple[DecoderWeights, DecoderShape] | None:
    """The layers as one `DecoderWeights`, or None unless every layer has the same shapes and options."""
    first = layers[0]
    eps = {
        n.eps for la in layers for n in (la.input_norm, la.post_attention_norm, la.attn_out_norm, la.mlp_out_norm) if n
    }
    if len({_same_shape(la) for la in layers}) != 1 or first.options.sinks is not None or len(eps) != 1:
        return None
    linears = [_stacked_linear([getattr(la, name) for la in layers]) for name in ("qkv", "o", "gate_up", "down")]
    qkv, o, gate_up, down = linears
    if qkv is None or o is None or gate_up is None or down is None:
        return None
    head_dim = qkv.bias.shape[1] // (first.n_heads + 2 * first.n_kv_heads)
    hidden = first.input_norm.weight.shape[0]
    weights = DecoderWeights(
        input_norm=_stack_norms([la.input_norm for la in layers], hidden),
        post_attention_norm=_stack_norms([la.post_attention_norm for la in layers], hidden),
        attn_out_norm=_stack_norms([la.attn_out_norm for la in layers], hidden),
        mlp_out_norm=_stack_norms([la.mlp_out_norm for la in layers], hidden),
        qkv=qkv,
        o=o,
        gate_up=gate_up,
        down=down,
        q_norm=_stack_norms([la.q_norm for la in layers], head_dim),
        k_norm=_stack_norms([la.k_norm for la in layers], head_dim),
        rope_inv_freq=np.stack([la.rope.inv_freq for la in layers]).astype(np.float32),
        rope_scales=np.array([la.rope.scale for la in layers], np.float32),
        rope_mscales=np.array([la.rope.mscale for la in layers], np.float32),
        sliding_windows=np.array([la.options.sliding_window or 0 for la in layers], np.int64),
    )
    shape = DecoderShape(
        n_heads=first.n_heads,
        n_kv_heads=first.n_kv_heads,
        head_dim=head_dim,
        head_norms=first.q_norm is not None,
        norm_eps=first.input_norm.eps,
        head_norm_eps=first.q_norm.eps if first.q_norm else 0.0,
        attention_scale=first.options.scale,
        softcap=first.options.softcap or 0.0,
        sandwich_norms=first.attn_out_norm is not None,
        gelu=first.activation == "gelu_tanh",
    )
    return weights, shape
