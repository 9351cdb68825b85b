"""Tiny random-weight model directories (config.json + safetensors + tokenizer) that every rank loads."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from tests.executor.tiny_models import tiny_model
from tests.loader.tiny_tokenizer import save_hf_tokenizer, vocab_tokens
from tests.models.archs import build


def write_tiny_dir(
    path: Path,
    model_type: str = "llama",
    seed: int = 0,
    layers: int = 4,
    quantize_bits: int | None = None,
    model: nn.Module | None = None,
) -> Path:
    """`quantize_bits`: store the weights quantized (affine, groups of 32), as mlx-community checkpoints are;
    `model`: one already built (e.g. with a config of several layer groups), else one of `model_type`."""
    vocab = len(vocab_tokens())
    overrides = dict(num_hidden_layers=layers, vocab_size=vocab, eos_token_id=2)
    if model is not None:
        pass
    elif model_type in ("llama", "mistral", "qwen2", "qwen3"):
        model = tiny_model(model_type, seed=seed, **overrides)
    else:  # the other covered architectures' tiny configs (tests/models/archs.py)
        model = build(model_type, seed=seed, **overrides)
    if quantize_bits is not None:
        nn.quantize(model, group_size=32, bits=quantize_bits)
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), dict(nn.utils.tree_flatten(model.parameters())))
    # A variant of tests/models/archs.py ("llama+yarn_rope") names the type it is built as.
    config = {**model.args.__dict__, "model_type": model.model_type, "architectures": ["LlamaForCausalLM"]}
    if quantize_bits is not None:
        config["quantization"] = {"group_size": 32, "bits": quantize_bits}
    (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if _plain(v)}))
    save_hf_tokenizer(path)
    return path


def _plain(value: object) -> bool:
    return isinstance(value, (int, float, str, bool, list, dict)) or value is None
