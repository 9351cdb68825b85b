"""Model loading: GGUF files, MLX/HF directories, hub ids and the embedded default model.

Importing this package does not import MLX, so `metalserve/__init__.py` can load the BLAS first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from metalserve.loader.errors import ModelLoadError
from metalserve.loader.loaded import LoadedModel

__all__ = [
    "LoadedModel",
    "ModelLoadError",
    "load_model",
]


def load_model(
    model: str | None,
    *,
    weights: str = "auto",
    dequantize_max_bytes: int = 4 << 30,
    chat_template: str | None = None,
    prepare: Callable[[Any], None] | None = None,
    hf_overrides: Mapping[str, Any] | None = None,
    check_model_type: Callable[[str], None] | None = None,
) -> LoadedModel:
    """Load `model`: None (the embedded default), a .gguf file, a model directory or a hub repo id.

    `weights`: "auto" (fp32 on CPU when it fits in `dequantize_max_bytes`), "dequantize" or "quantized".
    `chat_template` overrides the model's own. `prepare` gets the built mlx-lm model before its weights
    are converted and materialised (a pipeline rank drops the layers it does not hold).
    `check_model_type` gets the config's model_type before the model is built and raises ValueError for
    one the caller cannot serve (the engine passes executor/models/families.py's `check_supported`: the
    loader itself knows no model family). `hf_overrides` edits the
    model's config before it is built (`--hf-overrides`, e.g. a RoPE scaling). Every user-facing failure is
    a ModelLoadError.
    """
    from metalserve.loader.load import load  # heavy (MLX, transformers): only when a model is loaded

    return load(
        model,
        weights=weights,
        dequantize_max_bytes=dequantize_max_bytes,
        chat_template=chat_template,
        prepare=prepare,
        check_model_type=check_model_type,
        hf_overrides=hf_overrides,
    )
