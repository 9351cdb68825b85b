"""GGUF tensors -> mlx-lm llama parameter names, with llama.cpp's Q/K row permutation undone."""

from __future__ import annotations

import re

import mlx.core as mx

from metalserve.loader.errors import ModelLoadError

# Tensor types `mx.load` reads: the three quantized ones land in MLX's affine layout (group 32).
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "Q4_0", "Q4_1", "Q8_0")

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|scales|biases|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|scales|biases|bias)$")


def check_tensor_types(tensor_types: dict[str, str]) -> None:
    """Refuse a file with a tensor type MLX cannot load, naming the type and a tensor that has it."""
    for name, kind in tensor_types.items():
        if kind not in SUPPORTED_TENSOR_TYPES:
            raise ModelLoadError(
                f"The GGUF tensor {name!r} has type {kind}, which is not supported (supported: "
                f"{', '.join(SUPPORTED_TENSOR_TYPES)}); use a Q4_0, Q4_1, Q8_0, F16 or F32 GGUF."
            )


def map_name(name: str) -> str:
    """The mlx-lm parameter name of a GGUF tensor (or of its .scales/.biases companion)."""
    if m := _LAYER_RE.match(name):
        layer, part, suffix = m.groups()
        if part in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"
    elif (m := _GLOBAL_RE.match(name)) and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    raise ModelLoadError(f"The GGUF tensor {name!r} has no place in a llama model; is this a llama GGUF?")


def unpermute_rows(w: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's per-head interleaving of Q/K rows, so standard (non-traditional) RoPE applies.

    Works on packed quantized weights, scales and biases alike: only rows move.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert_weights(tensors: dict[str, mx.array], num_heads: int, num_kv_heads: int) -> dict[str, mx.array]:
    """Rename every tensor and un-permute the Q and K projections."""
    out: dict[str, mx.array] = {}
    for name, w in tensors.items():
        new = map_name(name)
        if ".self_attn.q_proj." in new:
            w = unpermute_rows(w, num_heads)
        elif ".self_attn.k_proj." in new:
            w = unpermute_rows(w, num_kv_heads)
        out[new] = w
    return out
