"""--hf-overrides reaches the model (a RoPE scaling changes its logits exactly as mlx-lm's own model with
that config computes them, through the real engine too), and --max-model-len past the trained context
needs --allow-long-max-model-len."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import gguf
import mlx.nn as nn
import numpy as np
import pytest

from metalserve.config import ConfigError, EngineConfig
from metalserve.loader import ModelLoadError, load_model
from metalserve.loader.build import model_classes
from metalserve.loader.overrides import apply_hf_overrides, scaled_context
from metalserve.serving.context_len import resolve_max_model_len
from tests.loader.tiny_models import logits, tiny_config, write_gguf
from tests.models import golden

LINEAR = {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}
YARN = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}}
TOKENS = [5, 9, 3, 17, 8, 11, 4, 20, 6, 13, 7, 2]


def _reference(weights: dict[str, Any], overrides: dict[str, Any] | None) -> nn.Module:
    """mlx-lm's llama built from the overridden config, with the GGUF's weights."""
    model_cls, args_cls = model_classes("llama")
    model = model_cls(args_cls.from_dict(apply_hf_overrides(tiny_config("llama"), overrides)))
    model.load_weights(list(weights.items()), strict=True)
    return model


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    path = tmp_path_factory.mktemp("hf") / "tiny.gguf"
    return path, write_gguf(path, gguf.GGMLQuantizationType.F32)


def test_linear_scaling_reaches_the_model(gguf_file: tuple[Path, dict[str, Any]]) -> None:
    path, weights = gguf_file
    loaded = load_model(str(path), weights="dequantize", hf_overrides=LINEAR)
    rope = loaded.model.model.layers[0].self_attn.rope
    assert type(rope) is nn.RoPE and rope.scale == 0.5
    assert loaded.max_model_len == 256 and loaded.rope_scaled_len == 512
    got = logits(loaded.model, TOKENS)
    scaled, plain = logits(_reference(weights, LINEAR), TOKENS), logits(_reference(weights, None), TOKENS)
    np.testing.assert_allclose(got, scaled, atol=1e-4)
    # Position 0 has no rotation, so the first token's logits do not move; every later one does.
    np.testing.assert_allclose(got[0], plain[0], atol=1e-4)
    assert all(np.abs(got[i] - plain[i]).max() > 1e-2 for i in range(1, len(TOKENS)))


@pytest.mark.parametrize("overrides", [LINEAR, YARN], ids=["linear", "yarn"])
def test_scaled_model_serves_like_mlx_lm(gguf_file: tuple[Path, dict[str, Any]], overrides: dict[str, Any]) -> None:
    """The engine runs RoPE per token on the packed axis: the scaled rotation must survive that."""
    path, weights = gguf_file
    loaded = load_model(str(path), weights="dequantize", hf_overrides=overrides)
    prompt = golden.prompts([40], vocab=64)[0]
    [served] = golden.serve(golden.engine(loaded.model, "llama"), [prompt], n=6)
    golden.check(served, golden.reference(_reference(weights, overrides), prompt, n=6))


def test_dynamic_scaling_is_refused_at_start_up(gguf_file: tuple[Path, dict[str, Any]]) -> None:
    path, _ = gguf_file
    dynamic = {"rope_scaling": {"type": "dynamic", "factor": 2.0}}
    # Its base depends on the sequence length, which has no per-token meaning on the packed axis.
    loaded = load_model(str(path), weights="dequantize", hf_overrides=dynamic)
    with pytest.raises(ValueError, match="dynamic NTK"):
        golden.engine(loaded.model, "llama")
    with pytest.raises(ModelLoadError, match="factor"):
        load_model(str(path), hf_overrides={"rope_scaling": {"rope_type": "linear", "factor": "big"}})


def test_overrides_merge_nested_objects() -> None:
    config = {"a": 1, "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "beta_fast": 32}}
    merged = apply_hf_overrides(config, {"rope_scaling": {"factor": 4.0}, "b": [1]})
    assert merged == {"a": 1, "b": [1], "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32}}
    assert config["rope_scaling"]["factor"] == 2.0  # the original is untouched
    assert scaled_context(merged, 1000) == 4000 and scaled_context(YARN, 9999) == 1024
    assert scaled_context({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 100) is None
    with pytest.raises(ConfigError, match="JSON object"):
        EngineConfig(hf_overrides=[1])  # type: ignore[arg-type]


def test_long_context_needs_the_opt_in(caplog: pytest.LogCaptureFixture) -> None:
    assert resolve_max_model_len(EngineConfig(), 8192, 32768) == 8192  # scaling alone does not lengthen
    assert resolve_max_model_len(EngineConfig(max_model_len=4096), 8192) == 4096
    with pytest.raises(ConfigError, match="--allow-long-max-model-len") as refused:
        resolve_max_model_len(EngineConfig(max_model_len=32768), 8192, 32768)
    assert "covers 32768" in str(refused.value)
    allowed = EngineConfig(max_model_len=32768, allow_long_max_model_len=True)
    with caplog.at_level(logging.WARNING, logger="metalserve.engine"):
        assert resolve_max_model_len(allowed, 8192, 32768, warn=True) == 32768
        assert resolve_max_model_len(allowed, 8192, None, warn=True) == 32768
    warned = [r.getMessage() for r in caplog.records]
    assert "within what the RoPE scaling covers (32768)" in warned[0]
    assert "never trained" in warned[1]
