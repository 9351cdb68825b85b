"""Vision-language model directories (a config.json with a `vision_config`), built by mlx-vlm.

mlx-vlm's own loader reads the weights (sanitizing HF names, quantizing what is packed) into its model
classes; the language model then runs in metalserve's paged step and the tower on the engine thread.
The image processor is mlx-vlm's NumPy one (multimodal/processor.py); HF_HUB_OFFLINE keeps its
processors from looking on the hub for files a local directory lacks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.nn as nn

from metalserve.loader.errors import ModelLoadError
from metalserve.loader.loaded import RawModel


def is_vision_directory(path: Path) -> bool:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("vision_config"), dict)


def language_model_of(vlm: nn.Module) -> nn.Module:
    """The language model the paged step serves. Gemma 3's (mlx-vlm) keeps its config as `config`, where
    the attention traits read `args` as mlx-lm's models name it: the same object under both names."""
    language = vlm.language_model
    if not hasattr(language, "args"):
        language.args = language.config
    return language


def load_vision_directory(path: Path) -> RawModel:
    """config.json + weights + tokenizer + preprocessor_config.json -> RawModel with the mlx-vlm model built."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from mlx_vlm.utils import load_model
    except ImportError as exc:
        raise ModelLoadError(
            f"{path} is a vision-language model: install the vision extra (pip install 'metalserve[vision]')"
        ) from exc
    from mlx.utils import tree_flatten

    from metalserve.loader.directory import _load_tokenizer, _stored_as
    from metalserve.multimodal.images import ImageError
    from metalserve.multimodal.processor import image_processor_for

    config = json.loads((path / "config.json").read_text())
    try:
        processor = image_processor_for(config, path)  # refuses a family without image support first
    except ImageError as exc:
        raise ModelLoadError(str(exc)) from exc
    try:
        model = load_model(path)
    except (ValueError, KeyError, TypeError, FileNotFoundError) as exc:
        raise ModelLoadError(f"mlx-vlm could not load {path}: {exc}") from exc
    tokenizer = _load_tokenizer(path)
    processor = image_processor_for(config, path, tokenizer)  # Gemma 3 lays out an image's text with it
    template = getattr(tokenizer, "chat_template", None)
    stored = _stored_as(config, dict(tree_flatten(model.parameters())))
    return RawModel(config, {}, tokenizer, template, stored, prebuilt=model, image_processor=processor)  # type: ignore[arg-type]
