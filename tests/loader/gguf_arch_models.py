"""Tiny random models of each GGUF architecture written as llama.cpp lays them out, with the weights a
correct loader must hand mlx-lm (the reference model is mlx-lm's class on those weights).

The conversions are written here from llama.cpp's converter's side (permute llama's Q/K rows, add 1 to
gemma's norms), independently of metalserve/loader/gguf_weights.py, which undoes them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from metalserve.loader.build import model_classes
from tests.loader.gguf_blocks import T, add_encoded, encode
from tests.loader.tiny_models import random_model
from tests.loader.tiny_tokenizer import add_gguf_tokenizer, vocab_tokens

# 256 wide, so every matrix's rows are whole K-quant super-blocks.
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN, EXPERTS = 256, 2, 4, 2, 64, 256, 4
_BASE = {
    "hidden_size": HIDDEN,
    "num_hidden_layers": LAYERS,
    "intermediate_size": FFN,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}
_EXTRA: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama"},
    # llama 3.1's rope (stored by llama.cpp as per-frequency factors), high factor to make it show.
    "llama3": {
        "model_type": "llama",
        "rope_scaling": {
            "type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    "qwen2": {"model_type": "qwen2"},
    "qwen3": {"model_type": "qwen3"},
    "qwen3moe": {
        "model_type": "qwen3_moe",
        "num_experts": EXPERTS,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": FFN,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    },
    "gemma3": {
        "model_type": "gemma3_text",
        "sliding_window": 8,
        "sliding_window_pattern": 2,
        "query_pre_attn_scalar": HEAD_DIM,
        "rope_theta": 1e6,
        "rope_local_base_freq": 10000.0,
        "rms_norm_eps": 1e-6,
    },
    "phi3": {
        "model_type": "phi3",
        "partial_rotary_factor": 0.5,
        "original_max_position_embeddings": 128,
        "tie_word_embeddings": False,
    },
}
_ATTN = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "post_attention_layernorm": "ffn_norm",
}
_TO_GGUF: dict[str, dict[str, str]] = {
    "llama": _ATTN,
    "llama3": _ATTN,
    "qwen2": _ATTN,
    "qwen3": _ATTN,
    "qwen3moe": {
        **_ATTN,
        "mlp.gate": "ffn_gate_inp",
        "mlp.switch_mlp.gate_proj": "ffn_gate_exps",
        "mlp.switch_mlp.up_proj": "ffn_up_exps",
        "mlp.switch_mlp.down_proj": "ffn_down_exps",
    },
    "gemma3": {
        **_ATTN,
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    },
    "phi3": {**_ATTN, "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
}
_GLOBALS = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
PHI3_LONG = [1.0 + 0.1 * i for i in range(HEAD_DIM // 4)]  # rope dims / 2 = 16 factors
PHI3_SHORT = [1.0 + 0.05 * i for i in range(HEAD_DIM // 4)]


def arch_config(arch: str) -> dict[str, Any]:
    config = {**_BASE, "vocab_size": len(vocab_tokens()), **_EXTRA[arch]}
    if arch == "phi3":
        config["rope_scaling"] = {"type": "longrope", "long_factor": PHI3_LONG, "short_factor": PHI3_SHORT}
    return config


def _gguf_name(hf: str, arch: str) -> tuple[str, str]:
    module, _, suffix = hf.rpartition(".")
    if module.startswith("model.layers."):
        _, _, layer, rest = module.split(".", 3)
        return f"blk.{layer}.{_TO_GGUF[arch][rest]}.{suffix}", rest
    return f"{_GLOBALS[module]}.{suffix}", module


def _permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row interleaving for llama rope (rows of bytes move the same way)."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _store(arch: str, module: str, w: np.ndarray) -> np.ndarray:
    """The stored form of an encoded HF tensor."""
    if arch in ("llama", "llama3") and module == "self_attn.q_proj":
        return _permute_rows(w, HEADS)
    if arch in ("llama", "llama3") and module == "self_attn.k_proj":
        return _permute_rows(w, KV_HEADS)
    return w


def _rope_freqs(config: dict[str, Any]) -> list[float]:
    """llama.cpp's converter's factors for llama-3 rope: 1 at high frequencies, the factor at low ones."""
    factor, base, old = config["rope_scaling"]["factor"], config["rope_theta"], 8192
    out = []
    for i in range(0, HEAD_DIM, 2):
        wavelen = 2 * np.pi * base ** (i / HEAD_DIM)
        smooth = (old / wavelen - 1) / (4 - 1)
        out.append(1.0 if wavelen < old / 4 else factor if wavelen > old else 1 / ((1 - smooth) / factor + smooth))
    return out


def _metadata(writer: gguf.GGUFWriter, arch: str, config: dict[str, Any]) -> None:
    writer.add_block_count(LAYERS)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_rope_dimension_count(HEAD_DIM // 2 if arch == "phi3" else HEAD_DIM)
    writer.add_vocab_size(config["vocab_size"])
    if arch == "qwen3moe":
        writer.add_expert_count(EXPERTS)
        writer.add_expert_used_count(2)
        writer.add_expert_feed_forward_length(FFN)
    if arch == "gemma3":
        writer.add_sliding_window(config["sliding_window"])
        writer.add_array(f"{arch}.attention.sliding_window_pattern", [True, False])  # per-layer flags
    if arch == "llama3":
        writer.add_tensor("rope_freqs.weight", np.array(_rope_freqs(config), dtype=np.float32))
    if arch == "phi3":
        writer.add_rope_scaling_orig_ctx_len(config["original_max_position_embeddings"])
        writer.add_tensor("rope_factors_long.weight", np.array(PHI3_LONG, dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(PHI3_SHORT, dtype=np.float32))
    add_gguf_tokenizer(writer)


def write_arch_gguf(
    path: Path, arch: str, kind: T, seed: int = 0, kinds: dict[str, T] | None = None
) -> dict[str, mx.array]:
    """Write a random `arch` model with its matrices in `kind` (or `kinds[suffix]` for GGUF tensor names
    ending in `suffix`, as a Q4_K_M file mixes Q6_K into attn_v and ffn_down); return the HF-layout weights
    it decodes to."""
    config = arch_config(arch)
    params = dict(tree_flatten(random_model(config, seed).parameters()))
    if config["tie_word_embeddings"]:
        params.pop("lm_head.weight", None)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama" if arch == "llama3" else arch)
    _metadata(writer, arch, config)
    reference: dict[str, mx.array] = {}
    for name, p in params.items():
        w = np.array(p, dtype=np.float32)
        gguf_name, module = _gguf_name(name, arch)
        own = next((k for suffix, k in (kinds or {}).items() if gguf_name.endswith(suffix)), kind)
        data, decoded = encode(w, own if w.ndim >= 2 else T.F32, rng)
        if arch == "gemma3" and name.endswith("norm.weight"):
            data = data + np.float32(1.0)  # llama.cpp folds gemma's (1 + w) into the stored norm
            decoded = data - np.float32(1.0)
        add_encoded(writer, gguf_name, _store(arch, module, data), own if w.ndim >= 2 else T.F32)
        reference[name] = mx.array(decoded)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


def reference_model(arch: str, weights: dict[str, mx.array]) -> nn.Module:
    """mlx-lm's own class on the decoded weights: what the GGUF must reproduce."""
    model_cls, args_cls = model_classes(arch_config(arch)["model_type"])
    model = model_cls(args_cls.from_dict(arch_config(arch)))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(dict(weights))
    model.load_weights(list(weights.items()), strict=True)
    return model
