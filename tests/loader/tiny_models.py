"""Small random-weight models written to disk: MLX directories (four families) and llama GGUFs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map

from metalserve.loader.build import model_classes
from tests.loader.tiny_tokenizer import add_gguf_tokenizer, save_hf_tokenizer, vocab_tokens

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 2, 4, 2, 16, 128


def tiny_config(model_type: str, tie: bool = True) -> dict[str, Any]:
    return {
        "model_type": model_type,
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "intermediate_size": FFN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-5,
        "vocab_size": len(vocab_tokens()),
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "tie_word_embeddings": tie,
        "eos_token_id": 2,
    }


def random_model(config: dict[str, Any], seed: int = 0) -> nn.Module:
    """An mlx-lm model whose every parameter (norms too) is random, so a misplaced weight shows."""
    model_cls, args_cls = model_classes(config["model_type"])
    model = model_cls(args_cls.from_dict(config))
    mx.random.seed(seed)
    model.update(
        tree_map(lambda p: mx.random.normal(p.shape) * 0.2 + (1.0 if p.ndim == 1 else 0.0), model.parameters())
    )
    return model


def write_mlx_dir(
    directory: Path,
    model_type: str,
    quantize_bits: int | None = None,
    tie: bool = True,
    dtype: mx.Dtype = mx.float32,
) -> Path:
    """config.json + model.safetensors (+ quantization) + tokenizer files, as mlx-community lays them out."""
    directory.mkdir(parents=True, exist_ok=True)
    config = tiny_config(model_type, tie)
    model = random_model(config)
    model.update(tree_map(lambda p: p.astype(dtype), model.parameters()))
    if quantize_bits is not None:
        nn.quantize(model, group_size=32, bits=quantize_bits)
        config["quantization"] = {"group_size": 32, "bits": quantize_bits}
    mx.save_safetensors(str(directory / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (directory / "config.json").write_text(json.dumps(config))
    save_hf_tokenizer(directory)
    return directory


def _permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row interleaving (the loader must undo it)."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf: str) -> str:
    if hf.startswith("model.layers."):
        _, _, layer, rest = hf.split(".", 3)
        module = rest.removesuffix(".weight")
        return f"blk.{layer}.{_GGUF_NAMES[module]}.weight"
    return {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }[hf]


def _add_tensor(writer: gguf.GGUFWriter, name: str, w: np.ndarray, kind: gguf.GGMLQuantizationType) -> None:
    """Write `w` as `kind`; 1-D tensors (norms) stay F32 as llama.cpp writes them."""
    if w.ndim == 1 or kind == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, w.astype(np.float32))
    elif kind == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(name, w.astype(np.float16))
    else:
        data = gguf.quants.quantize(w.astype(np.float32), kind)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)


def _write_metadata(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    writer.add_block_count(LAYERS)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])
    add_gguf_tokenizer(writer)


def write_gguf(
    path: Path, kind: gguf.GGMLQuantizationType, tie: bool = True, arch: str = "llama"
) -> dict[str, mx.array]:
    """A random llama as a GGUF; returns the HF-layout fp32 weights the file decodes to (the reference)."""
    config = tiny_config("llama", tie)
    hf = {k: np.array(v) for k, v in tree_flatten(random_model(config).parameters())}
    writer = gguf.GGUFWriter(str(path), arch)
    _write_metadata(writer, config)
    reference: dict[str, mx.array] = {}
    for name, w in hf.items():
        stored = w
        if "q_proj" in name:
            stored = _permute_rows(w, HEADS)
        elif "k_proj" in name:
            stored = _permute_rows(w, KV_HEADS)
        # Quantization is row-wise, so it commutes with the row permutation.
        _add_tensor(writer, _gguf_name(name), stored, kind)
        reference[name] = mx.array(_add_tensor_roundtrip(w, kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


def _add_tensor_roundtrip(w: np.ndarray, kind: gguf.GGMLQuantizationType) -> np.ndarray:
    """What a correct reader gets back from `_add_tensor`."""
    if w.ndim == 1 or kind == gguf.GGMLQuantizationType.F32:
        return w.astype(np.float32)
    if kind == gguf.GGMLQuantizationType.F16:
        return w.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(w.astype(np.float32), kind), kind).astype(np.float32)


def reference_llama(weights: dict[str, mx.array], tie: bool = True) -> nn.Module:
    """mlx-lm's llama with HF-layout weights: what the GGUF must reproduce."""
    model_cls, args_cls = model_classes("llama")
    model = model_cls(args_cls.from_dict(tiny_config("llama", tie)))
    model.load_weights(list(weights.items()), strict=True)
    return model


def logits(model: nn.Module, tokens: list[int]) -> np.ndarray:
    out = model(mx.array([tokens]))
    return np.array(out[0].astype(mx.float32))


def quantize_half_scales(model: nn.Module, group_size: int = 32, bits: int = 4) -> None:
    """`nn.quantize`, then each group's scale and offset rounded to float16, as MLX checkpoints of fp16 and
    bf16 models store them. The CPU path's codes keep such scales exactly (packed_codes.py), so its codes
    kernels and the dequantized fp32 twin then compute with one weight; this random fp32 model's own
    scales would round."""
    nn.quantize(model, group_size=group_size, bits=bits)
    for _, module in model.named_modules():
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            module.scales = module.scales.astype(mx.float16).astype(mx.float32)
            module.biases = module.biases.astype(mx.float16).astype(mx.float32)
    mx.eval(model.parameters())
