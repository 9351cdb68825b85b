"""Load a llama-family GGUF file: checks first, then tensors, config and tokenizer."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import mlx.core as mx

from metalserve.loader.errors import ModelLoadError
from metalserve.loader.gguf_config import SUPPORTED_GGUF_ARCHITECTURES, config_from_gguf
from metalserve.loader.gguf_header import GGUFFormatError, read_header
from metalserve.loader.gguf_tokenizer import tokenizer_from_gguf
from metalserve.loader.gguf_weights import check_tensor_types, convert_weights
from metalserve.loader.loaded import RawModel


def _check_header(path: Path) -> str:
    try:
        header = read_header(path)
    except GGUFFormatError as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}.") from exc
    if header.architecture not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF architecture {header.architecture!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)})."
        )
    check_tensor_types(header.tensor_types)
    # Name the file by its layers' type: the embedding is often stored differently.
    types = header.tensor_types
    layer_types = Counter(t for n, t in types.items() if n.startswith("blk.") and n.endswith("attn_q.weight"))
    return layer_types.most_common(1)[0][0] if layer_types else "F32"


def load_gguf(path: Path) -> RawModel:
    """Read the GGUF at `path` into a RawModel (weights un-permuted and renamed for mlx-lm's llama)."""
    stored_as = _check_header(path)
    try:
        tensors, metadata = mx.load(str(path), return_metadata=True)
    except RuntimeError as exc:
        raise ModelLoadError(f"MLX could not read the GGUF file {path}: {exc}") from exc
    assert isinstance(tensors, dict) and isinstance(metadata, dict)
    tensor_names = {n.removesuffix(".scales").removesuffix(".biases") for n in tensors}
    config = config_from_gguf(metadata, tensor_names)
    weights = convert_weights(tensors, config["num_attention_heads"], config["num_key_value_heads"])
    tokenizer = tokenizer_from_gguf(metadata, str(metadata["general.architecture"]))
    template = metadata.get("tokenizer.chat_template")
    return RawModel(config, weights, tokenizer, template if isinstance(template, str) else None, stored_as)
