"""Tiny random-weight model directories of every architecture the project covers, one per family in the
default run, built with the existing fixtures (mlx-lm's own classes), and mlx-lm's greedy tokens for them.

The reference loads the directory with mlx-lm's own `load_model` and runs mlx-lm's plain loop
(tests/models/golden.py): nothing of metalserve's loader or engine takes part in it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model

from tests.distributed.tiny_dir import write_tiny_dir
from tests.loader.tiny_tokenizer import save_hf_tokenizer
from tests.models.archs import ARCHS
from tests.models.hybrid_tiny import _BASE, CONFIGS, HYBRID_TYPES, tiny_hybrid
from tests.models.mla_golden import MODULES as MLA_TYPES
from tests.models.test_mla_loader import write_dir as write_mla_dir

# One architecture per family runs in the default test run; the rest of the matrix is slow.
FAMILIES = {
    "dense": "llama",
    "window": "gemma3_text",
    "moe": "qwen3_moe",
    "hybrid": "lfm2",
    "mla": "deepseek_v3",
    "shared_kv": "gemma4_text",
}
MATRIX = (*ARCHS, *HYBRID_TYPES, *MLA_TYPES)
VOCAB = 256  # prompts draw ids below every tiny model's vocabulary
# transformers validates config.json when it loads the tokenizer; mlx-lm does not read these fields.
HF_FIELDS: dict[str, dict[str, Any]] = {
    "exaone4": {"layer_types": ["sliding_attention"] * 3 + ["full_attention"]},  # as EXAONE 4.0 ships it
    "granitemoehybrid": {"mamba_expand": 1},  # mamba heads x head dim = expand x hidden
}


def write_model_dir(path: Path, arch: str) -> Path:
    """config.json + model.safetensors + tokenizer files for `arch` (a key of MATRIX)."""
    _write(path, arch)
    config = json.loads((path / "config.json").read_text())
    # A null the tiny config did not ask for is a default left unresolved: leave it to each reader.
    config = {k: v for k, v in config.items() if v is not None or k in ARCHS.get(arch, {})}
    config |= HF_FIELDS.get(arch, {})
    (path / "config.json").write_text(json.dumps(config))
    return path


def _write(path: Path, arch: str) -> None:
    if arch in HYBRID_TYPES:
        model = tiny_hybrid(arch)
        path.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
        (path / "config.json").write_text(json.dumps({"model_type": arch, **_BASE, **CONFIGS[arch]}))
        save_hf_tokenizer(path)
    elif arch in MLA_TYPES:
        write_mla_dir(path, arch)
    else:
        write_tiny_dir(path, arch, layers=4)


def mlx_lm_model(path: Path) -> nn.Module:
    """mlx-lm's own model for the directory (its `load_model`: none of metalserve's loader)."""
    model, _ = load_model(path)
    return model
