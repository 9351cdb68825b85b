"""Fixtures for the multi-process pipeline tests: tiny model directories on disk (every rank loads one)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from tests.distributed.tiny_dir import write_tiny_dir
from tests.loader.tiny_tokenizer import save_hf_tokenizer, vocab_tokens


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_dir(tmp_path_factory.mktemp("tiny") / "llama", "llama", seed=0, layers=4)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_dir(tmp_path_factory.mktemp("tiny") / "qwen3", "qwen3", seed=1, layers=5)


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_dir(tmp_path_factory.mktemp("tiny") / "qwen3_moe", "qwen3_moe", seed=2, layers=4)


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Sliding-window layers 0-1 and 3-4, full layers 2 and 5: three layer groups of two layers."""
    from tests.models.archs import build

    vocab = len(vocab_tokens())
    model = build("gemma3_text", seed=4, num_hidden_layers=6, sliding_window_pattern=3, vocab_size=vocab)
    return write_tiny_dir(tmp_path_factory.mktemp("tiny") / "gemma3", "gemma3_text", model=model)


def write_hybrid_dir(path: Path, model_type: str, seed: int) -> Path:
    from tests.models.hybrid_tiny import _BASE, CONFIGS, tiny_hybrid

    path.mkdir(parents=True)
    model = tiny_hybrid(model_type, seed=seed)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config = {"model_type": model_type, **_BASE, **CONFIGS[model_type], "eos_token_id": 2}
    (path / "config.json").write_text(json.dumps(config))
    save_hf_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_qwen3_next(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gated-delta (recurrent) layers 0 and 2, attention layers 1 and 3."""
    return write_hybrid_dir(tmp_path_factory.mktemp("tiny") / "qwen3_next", "qwen3_next", seed=5)


@pytest.fixture(scope="session")
def tiny_qwen3_5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gated-delta layers 0 and 2 (2 key / 4 value heads), gated attention layers 1 and 3; untied head."""
    return write_hybrid_dir(tmp_path_factory.mktemp("tiny") / "qwen3_5", "qwen3_5", seed=11)


@pytest.fixture(scope="session")
def tiny_nemotron_h(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Mamba layers 0 and 3, attention layer 2, MLP-only layers 1 and 4; the backbone is `backbone`."""
    return write_hybrid_dir(tmp_path_factory.mktemp("tiny") / "nemotron_h", "nemotron_h", seed=10)


@pytest.fixture(scope="session")
def tiny_deepseek_v3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MLA latent pages; one dense layer, then two MoE layers (in Hugging Face's layout on disk)."""
    from tests.models.test_mla_loader import write_dir

    path = tmp_path_factory.mktemp("tiny") / "deepseek_v3"
    write_dir(path, "deepseek_v3")
    return path
