"""An HF-style config dict (what mlx-lm's ModelArgs read) built from GGUF metadata (llama.cpp's keys)."""

from __future__ import annotations

from typing import Any

from metalserve.loader.errors import ModelLoadError
from metalserve.loader.gguf_arch_config import ARCH_EXTRAS, FACTOR_TENSORS, MODEL_TYPES, ROPE_SCALING_KINDS
from metalserve.loader.gguf_metadata import get, require

# mistral GGUFs say "llama" too.
SUPPORTED_GGUF_ARCHITECTURES = tuple(MODEL_TYPES)


def _rope_scaling(metadata: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = get(metadata, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind not in ROPE_SCALING_KINDS[arch]:
        raise ModelLoadError(
            f"The {arch} GGUF uses rope scaling {kind!r}, which metalserve does not support for it "
            f"(supported: {', '.join(ROPE_SCALING_KINDS[arch]) or 'none'})."
        )
    factor = float(require(metadata, f"{arch}.rope.scaling.factor"))
    if kind == "linear":
        return {"type": "linear", "factor": factor}
    original = int(require(metadata, f"{arch}.rope.scaling.original_context_length"))
    return {"type": "yarn", "factor": factor, "original_max_position_embeddings": original}


def check_architecture(arch: Any) -> str:
    if arch not in MODEL_TYPES:
        raise ModelLoadError(
            f"The GGUF architecture {arch!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}); use an MLX model directory for other families."
        )
    return str(arch)


def _common(metadata: dict[str, Any], arch: str, tensor_names: set[str]) -> dict[str, Any]:
    hidden = int(require(metadata, f"{arch}.embedding_length"))
    heads = int(require(metadata, f"{arch}.attention.head_count"))
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    return {
        "hidden_size": hidden,
        "num_hidden_layers": int(require(metadata, f"{arch}.block_count")),
        "intermediate_size": int(get(metadata, f"{arch}.feed_forward_length", 0)),
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


def config_from_gguf(
    metadata: dict[str, Any], tensor_names: set[str], rope_factors: dict[str, list[float]] | None = None
) -> dict[str, Any]:
    """The HF config of the file's architecture; tied embeddings when there is no output tensor.

    `rope_factors`: the file's per-frequency rope factor tensors by name (phi3's longrope), as lists."""
    arch = check_architecture(require(metadata, "general.architecture"))
    for name in rope_factors or {}:
        if name not in FACTOR_TENSORS.get(arch, ()):
            raise ModelLoadError(f"The {arch} GGUF carries {name!r}, which metalserve cannot apply to a {arch} model.")
    model_type, hf_architecture = MODEL_TYPES[arch]
    config = {"model_type": model_type, "architectures": [hf_architecture], **_common(metadata, arch, tensor_names)}
    config.update(ARCH_EXTRAS[arch](metadata, arch, config, tensor_names, rope_factors or {}))
    return config
