"""Adapter directories in mlx-lm's and PEFT's formats read to the same weights; bad ones are refused
with a message that names the adapter and what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from metalserve.config import ConfigError, EngineConfig
from metalserve.lora.files import AdapterError, read_adapter
from metalserve.serving.build import build_engine_core
from tests.lora.tiny_adapters import as_peft, loaded_of, make_mlx_lm_adapter


def test_peft_and_mlx_lm_files_read_to_the_same_scaled_weights(tmp_path: Path) -> None:
    mlx_lm = read_adapter("m", make_mlx_lm_adapter(tmp_path / "m", rank=4, scale=2.0), max_rank=16)
    peft = read_adapter("p", as_peft(tmp_path / "m", tmp_path / "p", alpha=8.0), max_rank=16)  # 8 / 4 = 2.0
    assert mlx_lm.rank == peft.rank == 4
    assert sorted(mlx_lm.modules) == sorted(peft.modules)
    assert "model.layers.1.self_attn.v_proj" in mlx_lm.modules
    for path, (a, b) in mlx_lm.modules.items():
        np.testing.assert_allclose(np.array(peft.modules[path][0]), np.array(a))
        np.testing.assert_allclose(np.array(peft.modules[path][1]), np.array(b))
    raw = mx.load(str(tmp_path / "m" / "adapters.safetensors"))["model.layers.0.self_attn.q_proj.lora_b"]  # type: ignore[index]
    np.testing.assert_allclose(np.array(mlx_lm.modules["model.layers.0.self_attn.q_proj"][1]), 2.0 * np.array(raw))
    assert mlx_lm.nbytes == sum(a.nbytes + b.nbytes for a, b in mlx_lm.modules.values()) > 0
    assert mlx_lm.key.startswith("m@") and mlx_lm.key != peft.key


def test_rslora_scales_by_the_square_root_of_the_rank(tmp_path: Path) -> None:
    folder = as_peft(make_mlx_lm_adapter(tmp_path / "m", rank=4), tmp_path / "p", alpha=8.0)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps(config | {"use_rslora": True}))
    plain = read_adapter("m", tmp_path / "m", 16).modules["model.layers.0.self_attn.q_proj"][1]  # scale 2.0
    rs = read_adapter("p", folder, 16).modules["model.layers.0.self_attn.q_proj"][1]  # 8 / sqrt(4) = 4.0
    np.testing.assert_allclose(np.array(rs), 2.0 * np.array(plain), rtol=1e-6)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"fine_tune_type": "dora"}, "fine_tune_type 'dora' is not served"),
        ({"lora_parameters": {"rank": 4}}, "lacks lora_parameters.rank or .scale"),
    ],
)
def test_mlx_lm_configs_that_are_not_plain_lora_are_refused(tmp_path: Path, change: dict, message: str) -> None:
    folder = make_mlx_lm_adapter(tmp_path / "m")
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps(config | change))
    with pytest.raises(AdapterError, match=message):
        read_adapter("m", folder, 16)


def test_missing_or_broken_files_are_refused(tmp_path: Path) -> None:
    folder = make_mlx_lm_adapter(tmp_path / "m")
    (folder / "adapter_config.json").write_text("{nope")
    with pytest.raises(AdapterError, match="LoRA adapter 'm': adapter_config.json is not JSON"):
        read_adapter("m", folder, 16)
    (folder / "adapter_config.json").unlink()
    with pytest.raises(AdapterError, match="no adapter_config.json in"):
        read_adapter("m", folder, 16)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "adapter_config.json").write_text("{}")
    with pytest.raises(AdapterError, match="holds neither adapters.safetensors nor adapter_model.safetensors"):
        read_adapter("e", empty, 16)


def test_full_weights_in_an_adapter_file_are_refused(tmp_path: Path) -> None:
    folder = make_mlx_lm_adapter(tmp_path / "m")
    weights = dict(mx.load(str(folder / "adapters.safetensors")))  # type: ignore[arg-type]
    weights["model.layers.0.self_attn.q_proj.weight"] = mx.zeros((64, 64))
    mx.save_safetensors(str(folder / "adapters.safetensors"), weights)
    with pytest.raises(AdapterError, match="q_proj.weight is not a LoRA weight"):
        read_adapter("m", folder, 16)


def test_an_expert_adapter_of_another_expert_count_or_on_a_dense_layer_is_refused(tmp_path: Path) -> None:
    keys = ["mlp.switch_mlp.gate_proj"]
    other = make_mlx_lm_adapter(tmp_path / "m", "qwen3_moe", keys=keys, num_experts=8)  # the model has 4
    config = EngineConfig(kv_cache_memory=1 << 22, enable_lora=True, lora_modules=(("experts", str(other)),))
    with pytest.raises(
        ConfigError,
        match="'experts': model.layers.0.mlp.switch_mlp.gate_proj adapts 8 experts, the model's layer has 4 experts",
    ):
        build_engine_core(config, loaded_of("qwen3_moe"))
    dense = make_mlx_lm_adapter(tmp_path / "d", "qwen3_moe", keys=["self_attn.q_proj"])
    weights = mx.load(str(dense / "adapters.safetensors"))
    # The same weights stacked as if q_proj had 4 experts: a dense layer takes no expert adapter.
    stacked = {k: mx.stack([v.T] * 4) for k, v in weights.items()}  # type: ignore[union-attr]
    mx.save_safetensors(str(dense / "adapters.safetensors"), stacked)
    config = EngineConfig(kv_cache_memory=1 << 22, enable_lora=True, lora_modules=(("d", str(dense)),))
    with pytest.raises(ConfigError, match="q_proj adapts 4 experts, the model's layer has one dense linear"):
        build_engine_core(config, loaded_of("qwen3_moe"))


def test_lora_flags_are_checked_together() -> None:
    with pytest.raises(ConfigError, match="--lora-modules needs --enable-lora"):
        EngineConfig(lora_modules=(("a", "/x"),))
    with pytest.raises(ConfigError, match="more than --max-loras 1"):
        EngineConfig(enable_lora=True, max_loras=1, lora_modules=(("a", "/x"), ("b", "/y")))
    with pytest.raises(ConfigError, match="a name of its own"):
        EngineConfig(enable_lora=True, lora_modules=(("a", "/x"), ("a", "/y")))
    with pytest.raises(ConfigError, match="--max-lora-rank must be at least 1"):
        EngineConfig(enable_lora=True, max_lora_rank=0)
