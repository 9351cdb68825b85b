"""Reading typed values out of the metadata dict that `mx.load(..., return_metadata=True)` returns."""

from __future__ import annotations

from typing import Any

from metalserve.loader.errors import ModelLoadError


def scalar(value: Any) -> Any:
    """An mx.array scalar (how MLX returns numbers and booleans) as a Python value."""
    return value.item() if hasattr(value, "item") else value


def to_python(value: Any) -> Any:
    """An mx.array (scalar or 1-D, as MLX returns numbers and number lists) as Python values."""
    return value.tolist() if hasattr(value, "tolist") else value


def get(metadata: dict[str, Any], key: str, default: Any = None) -> Any:
    value = metadata.get(key)
    return default if value is None else scalar(value)


def require(metadata: dict[str, Any], key: str) -> Any:
    value = get(metadata, key)
    if value is None:
        raise ModelLoadError(f"The GGUF file lacks the metadata key {key!r}; is it a model file?")
    return value
