"""Hugging Face repo ids: downloaded with huggingface_hub when online, a clear error when not."""

from __future__ import annotations

import re
from pathlib import Path

from metalserve.loader.errors import ModelLoadError

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
# What a model directory needs; skips other formats (pytorch .bin, onnx, gguf) that repos often carry.
_ALLOW = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt"]


def looks_like_repo_id(name: str) -> bool:
    return bool(_REPO_ID.match(name)) and not name.endswith((".gguf", ".safetensors"))


def download(repo_id: str) -> Path:
    """The local snapshot directory of `repo_id` (from the cache when offline and cached)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=_ALLOW))
    except Exception as exc:  # noqa: BLE001 - offline, not found, gated, network: all mean "cannot get it"
        raise ModelLoadError(
            f"Cannot download the model {repo_id!r} from the Hugging Face hub ({type(exc).__name__}: {exc}). "
            "Pass a local path instead (a .gguf file or a model directory), or make the hub reachable "
            "(network access, and HF_HUB_OFFLINE unset)."
        ) from exc
