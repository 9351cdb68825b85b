"""An HF-style llama config dict built from GGUF metadata (llama.cpp's key names)."""

from __future__ import annotations

from typing import Any

from metalserve.loader.errors import ModelLoadError
from metalserve.loader.gguf_metadata import get, require

SUPPORTED_GGUF_ARCHITECTURES = ("llama",)  # mistral GGUFs say "llama" too


def _rope_scaling(metadata: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = get(metadata, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"type": "linear", "factor": float(require(metadata, f"{arch}.rope.scaling.factor"))}
    raise ModelLoadError(f"The GGUF uses rope scaling {kind!r}, which metalserve does not support yet.")


def config_from_gguf(metadata: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """The HF config mlx-lm's llama ModelArgs reads; tied embeddings when there is no output tensor."""
    arch = require(metadata, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"The GGUF architecture {arch!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}); use an MLX model directory for other families."
        )
    if "rope_freqs.weight" in tensor_names:
        raise ModelLoadError("The GGUF carries llama-3 rope frequency factors, which are not supported yet.")
    hidden = int(require(metadata, f"{arch}.embedding_length"))
    heads = int(require(metadata, f"{arch}.attention.head_count"))
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(require(metadata, f"{arch}.block_count")),
        "intermediate_size": int(require(metadata, f"{arch}.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get(metadata, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(get(metadata, f"{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get(metadata, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "vocab_size": int(get(metadata, f"{arch}.vocab_size", len(tokens))),
        "rope_theta": float(get(metadata, f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(metadata, arch),
        "max_position_embeddings": int(get(metadata, f"{arch}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": get(metadata, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": get(metadata, "tokenizer.ggml.eos_token_id"),
    }
