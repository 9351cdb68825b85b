"""GGUF tensors -> mlx-lm parameter names, with llama.cpp's conversions undone.

- llama: Q/K rows are interleaved per head for llama.cpp's rope; neox-rope families (qwen, gemma, phi3)
  are stored unpermuted.
- gemma3: every RMSNorm weight is stored with +1 folded in; mlx-lm's gemma RMSNorm adds the 1 itself.
- phi3 keeps its fused qkv and gate_up tensors, as mlx-lm's phi3 does; qwen3moe's experts are stacked
  3-D tensors, which is mlx-lm's SwitchGLU layout already.
"""

from __future__ import annotations

import re

import mlx.core as mx

from metalserve.loader.errors import ModelLoadError
from metalserve.loader.gguf_header import DENSE_TYPES, DEQUANTIZED_TYPES

# Tensor types `mx.load` reads exactly: the three quantized ones land in MLX's affine layout (group 32).
MLX_NATIVE_TYPES = ("F32", "F16", "Q4_0", "Q4_1", "Q8_0")
SUPPORTED_TENSOR_TYPES = tuple(dict.fromkeys(DENSE_TYPES + DEQUANTIZED_TYPES))
# Per-frequency rope factors: config, not parameters (gguf_arch_config.py reads them).
ROPE_FACTOR_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight", "rope_freqs.weight")

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_ATTENTION = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_DENSE_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_LLAMA = {**_ATTENTION, "ffn_norm": "post_attention_layernorm", **_DENSE_MLP}
_QWEN3MOE = {
    **_ATTENTION,
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
}
_GEMMA3 = {
    **_ATTENTION,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    **_DENSE_MLP,
}
_PHI3 = {
    "attn_norm": "input_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.gate_up_proj",  # llama.cpp stores phi3's fused gate/up under ffn_up
    "ffn_down": "mlp.down_proj",
}
LAYER_NAMES = {
    "llama": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA,
    "qwen3moe": _QWEN3MOE,
    "gemma3": _GEMMA3,
    "phi3": _PHI3,
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|scales|biases|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|scales|biases|bias)$")


def check_tensor_types(tensor_types: dict[str, str]) -> None:
    """Refuse a file with a tensor type metalserve cannot read, naming the type and a tensor that has it."""
    for name, kind in tensor_types.items():
        if kind not in SUPPORTED_TENSOR_TYPES:
            raise ModelLoadError(
                f"The GGUF tensor {name!r} has type {kind}, which is not supported (supported: "
                f"{', '.join(SUPPORTED_TENSOR_TYPES)})."
            )


def map_name(name: str, arch: str = "llama") -> str:
    """The mlx-lm parameter name of a GGUF tensor (or of its .scales/.biases companion)."""
    layer_names = LAYER_NAMES[arch]
    if m := _LAYER_RE.match(name):
        layer, part, suffix = m.groups()
        if part in layer_names:
            return f"model.layers.{layer}.{layer_names[part]}.{suffix}"
    elif (m := _GLOBAL_RE.match(name)) and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    raise ModelLoadError(f"The GGUF tensor {name!r} has no place in a {arch} model; is the file a {arch} GGUF?")


def unpermute_rows(w: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's per-head interleaving of Q/K rows, so standard (non-traditional) RoPE applies.

    Works on packed quantized weights, scales and biases alike: only rows move.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _convert(new: str, w: mx.array, arch: str, num_heads: int, num_kv_heads: int) -> mx.array:
    if arch == "llama" and ".self_attn.q_proj." in new:
        return unpermute_rows(w, num_heads)
    if arch == "llama" and ".self_attn.k_proj." in new:
        return unpermute_rows(w, num_kv_heads)
    if arch == "gemma3" and new.endswith("norm.weight"):
        return (w.astype(mx.float32) - 1.0).astype(w.dtype)
    return w


def convert_weights(
    tensors: dict[str, mx.array], num_heads: int, num_kv_heads: int, arch: str = "llama"
) -> dict[str, mx.array]:
    """Rename every tensor and undo the architecture's stored conversions."""
    return {
        (new := map_name(name, arch)): _convert(new, w, arch, num_heads, num_kv_heads) for name, w in tensors.items()
    }
