"""Load an MLX-format (or plain HF safetensors) model directory, as mlx-community publishes them."""

from __future__ import annotations

import glob
from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import load_config
from transformers import AutoTokenizer

from metalserve.loader.build import model_classes
from metalserve.loader.errors import ModelLoadError
from metalserve.loader.loaded import RawModel


def _stored_as(config: dict, weights: dict[str, mx.array]) -> str:
    quant = config.get("quantization")
    if isinstance(quant, dict) and "bits" in quant:
        return f"{quant['bits']}-bit {quant.get('mode', 'affine')} (group {quant.get('group_size', 64)})"
    floats = [w.dtype for w in weights.values() if mx.issubdtype(w.dtype, mx.floating)]
    return str(max(set(floats), key=floats.count)).removeprefix("mlx.core.") if floats else "unknown"


def _load_tokenizer(path: Path) -> object:
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, TypeError) as exc:
        raise ModelLoadError(f"No usable tokenizer in {path} (tokenizer.json / tokenizer_config.json): {exc}") from exc


def load_directory(path: Path) -> RawModel:
    """config.json + model*.safetensors + tokenizer files -> RawModel."""
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"{path} has no config.json, so it is not a model directory; pass a directory with config.json "
            "and *.safetensors (as mlx-community publishes them) or a .gguf file."
        )
    try:
        config = load_config(path)
    except ValueError as exc:
        raise ModelLoadError(f"{path / 'config.json'} is not valid JSON: {exc}") from exc
    if "model_type" not in config:
        raise ModelLoadError(f"{path / 'config.json'} has no model_type.")
    model_classes(config["model_type"])  # refuse unsupported families before reading weights
    files = sorted(glob.glob(str(path / "model*.safetensors")))
    if not files:
        raise ModelLoadError(f"{path} has no model*.safetensors weight files.")
    weights: dict[str, mx.array] = {}
    for file in files:
        loaded = mx.load(file)
        assert isinstance(loaded, dict)
        weights.update(loaded)
    tokenizer = _load_tokenizer(path)
    template = getattr(tokenizer, "chat_template", None)
    return RawModel(config, weights, tokenizer, template, _stored_as(config, weights))  # type: ignore[arg-type]
