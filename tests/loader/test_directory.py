"""MLX model directories (llama, mistral, qwen2, qwen3; dense and quantized) load like mlx-lm loads them."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_map
from mlx_lm.utils import load as mlx_lm_load

from metalserve.cli import main
from metalserve.executor.models.families import check_supported, kv_shape
from metalserve.loader import ModelLoadError, load_model
from tests.loader.tiny_models import logits, write_mlx_dir

TOKENS = [1, 40, 41, 260, 261, 7, 99, 2, 150, 33]


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("bits", [None, 4])
def test_logits_match_mlx_lm(tmp_path: Path, model_type: str, bits: int | None) -> None:
    path = write_mlx_dir(tmp_path / model_type, model_type, quantize_bits=bits)
    expected = logits(mlx_lm_load(str(path))[0], TOKENS)
    kept = load_model(str(path), weights="quantized")
    assert kept.model_type == model_type
    assert isinstance(kept.model.model.layers[0].mlp.up_proj, nn.QuantizedLinear) == (bits is not None)
    np.testing.assert_allclose(logits(kept.model, TOKENS), expected, atol=1e-4, rtol=1e-4)
    dense = load_model(str(path), weights="dequantize")
    assert isinstance(dense.model.model.layers[0].mlp.up_proj, nn.Linear)
    assert kv_shape(dense).dtype == mx.float32
    np.testing.assert_allclose(logits(dense.model, TOKENS), expected, atol=1e-4, rtol=1e-4)


def test_bf16_directory_runs_in_fp32_on_cpu(tmp_path: Path) -> None:
    path = write_mlx_dir(tmp_path / "bf16", "qwen2", dtype=mx.bfloat16)
    loaded = load_model(str(path))
    assert loaded.weights_desc.startswith("fp32 (cast from bfloat16")
    assert loaded.model.model.layers[0].self_attn.q_proj.weight.dtype == mx.float32
    reference = mlx_lm_load(str(path))[0]
    reference.update(tree_map(lambda p: p.astype(mx.float32), reference.parameters()))
    np.testing.assert_allclose(logits(loaded.model, TOKENS), logits(reference, TOKENS), atol=1e-4, rtol=1e-4)


def test_untied_lm_head(tmp_path: Path) -> None:
    path = write_mlx_dir(tmp_path / "untied", "llama", tie=False)
    loaded = load_model(str(path))
    assert "lm_head" in loaded.model
    expected = logits(mlx_lm_load(str(path))[0], TOKENS)
    np.testing.assert_allclose(logits(loaded.model, TOKENS), expected, atol=1e-4, rtol=1e-4)


def test_tokenizer_template_and_kv_facts(tmp_path: Path) -> None:
    path = write_mlx_dir(tmp_path / "m", "qwen3")
    loaded = load_model(str(path))
    assert kv_shape(loaded)[:3] == (2, 2, 16) and loaded.max_model_len == 256
    assert loaded.eos_token_ids == frozenset({2})
    text = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_chat_template_override(tmp_path: Path) -> None:
    path = write_mlx_dir(tmp_path / "m", "llama")
    loaded = load_model(str(path), chat_template="{{ messages[0]['content'] }}!")
    assert loaded.chat_template == "{{ messages[0]['content'] }}!"
    out = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "yo"}], tokenize=False)
    assert out == "yo!"


def test_directory_without_config_json(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_model(str(tmp_path))


def test_unsupported_model_type(tmp_path: Path) -> None:
    """The loader asks the caller's check (the engine passes the families registry's) before it builds."""
    path = write_mlx_dir(tmp_path / "m", "llama")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neox"}))
    with pytest.raises(ModelLoadError, match="'gpt_neox' is not supported.*llama, mistral, qwen2, qwen3"):
        load_model(str(path), check_model_type=check_supported)
    (path / "config.json").write_text(json.dumps({**config, "model_type": "no_such_family"}))
    with pytest.raises(ModelLoadError, match="mlx-lm has no model class for model type 'no_such_family'"):
        load_model(str(path))


def test_the_cli_refuses_an_unsupported_model_type(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_mlx_dir(tmp_path / "m", "llama")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neox"}))
    assert main(["generate", str(path), "--prompt", "hi"]) == 1
    assert "Model type 'gpt_neox' is not supported (supported: llama, mistral" in capsys.readouterr().err


def test_missing_weights(tmp_path: Path) -> None:
    path = write_mlx_dir(tmp_path / "m", "llama")
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no model\\*.safetensors"):
        load_model(str(path))


def test_weights_that_do_not_match_the_config(tmp_path: Path) -> None:
    path = write_mlx_dir(tmp_path / "m", "llama")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(ModelLoadError, match="do not match the model config"):
        load_model(str(path))
