"""The model-family registry (executor/models/families.py): what each family is, what follows for a built
model, and that no other module tests a model_type itself."""

from __future__ import annotations

import ast
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from metalserve.executor.host import paged_model
from metalserve.executor.models.compute import MlxCompute
from metalserve.executor.models.families import (
    HOST_MODEL_TYPES,
    MLA_MODEL_TYPES,
    SUPPORTED_MODEL_TYPES,
    KVShape,
    UnsupportedModelType,
    kv_shape,
    model_family,
)
from metalserve.executor.models.hybrid_families import FAMILIES
from metalserve.kernels.cpu.packed_codes import PackedCodes
from metalserve.platform import Platform
from tests.executor.tiny_models import tiny_model
from tests.models import golden
from tests.models.archs import WINDOW, build
from tests.models.hybrid_tiny import tiny_hybrid_loaded
from tests.models.mla_golden import loaded_of as mla_loaded_of
from tests.models.mla_golden import tiny_mla

ROOT = Path(__file__).resolve().parents[2]


def test_every_family_the_registry_names_is_a_supported_type() -> None:
    assert len(set(SUPPORTED_MODEL_TYPES)) == len(SUPPORTED_MODEL_TYPES)
    assert set(FAMILIES) | MLA_MODEL_TYPES | HOST_MODEL_TYPES <= set(SUPPORTED_MODEL_TYPES)
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3"} == HOST_MODEL_TYPES
    for model_type in SUPPORTED_MODEL_TYPES:
        family = model_family(model_type)
        assert (family.hybrid is not None) == (model_type in FAMILIES)
        assert family.mla == (model_type in MLA_MODEL_TYPES)
        assert family.host_path == (model_type in HOST_MODEL_TYPES)
        assert not (family.host_path and (family.hybrid or family.mla))  # the host twins are dense llama blocks


def test_an_unsupported_type_is_refused_naming_the_supported_ones() -> None:
    with pytest.raises(UnsupportedModelType, match=r"model type 'gpt_neox' is not supported \(supported: llama, "):
        model_family("gpt_neox")


def test_dense_windowed_latent_and_hybrid_models_read_off_by_their_family() -> None:
    llama = golden.loaded_of(tiny_model("llama"), "llama")
    assert kv_shape(llama) == KVShape(2, 2, 16, None, mx.float32)
    assert model_family("llama").sliding_windows(llama.model) == ()
    assert model_family("llama").state_layers(llama.model) == ()
    gemma3 = build("gemma3_text")
    assert model_family("gemma3_text").sliding_windows(gemma3) == (WINDOW,)
    mla = mla_loaded_of(tiny_mla("deepseek_v3"), "deepseek_v3")
    assert kv_shape(mla)[:4] == (3, 1, 40, 32)  # one latent "head" of kv_lora + rope, V its first kv_lora
    hybrid = tiny_hybrid_loaded("lfm2")
    assert model_family("lfm2").state_layers(hybrid.model) == (0, 2)
    assert kv_shape(hybrid)[:3] == (2, 2, 16)  # the attention layers only


def _codes() -> dict[str, PackedCodes]:
    codes = PackedCodes.pack(np.zeros((4, 32), np.uint8), np.ones((4, 1), np.float32), np.zeros((4, 1), np.float32), 4)
    return {"model.layers.0.mlp.down_proj": codes}


def test_the_stored_codes_stay_only_for_a_family_on_the_host_path() -> None:
    cpu = Platform(on_cpu=True, metal=False, numba=True, blas="test")
    hybrid = tiny_hybrid_loaded("lfm2")
    hybrid.codes.update(_codes())  # the loader keeps them on MLX's CPU backend, whatever the family
    assert isinstance(paged_model(hybrid, cpu).compute, MlxCompute)
    assert hybrid.codes == {}
    llama = golden.loaded_of(tiny_model("llama"), "llama")
    llama.codes.update(_codes())
    assert not isinstance(paged_model(llama, cpu).compute, MlxCompute)
    assert set(llama.codes) == {"model.layers.0.mlp.down_proj"}


def _model_type_tests(path: Path) -> list[int]:
    """Lines that compare something named model_type against a collection (`in`, `not in`) or a string."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        sides = (node.left, *node.comparators)
        names = [n.attr if isinstance(n, ast.Attribute) else getattr(n, "id", None) for n in sides]
        if "model_type" in names:
            lines.append(node.lineno)
    return lines


def test_one_module_tests_a_model_type() -> None:
    found = {
        str(p.relative_to(ROOT)): lines
        for p in sorted((ROOT / "metalserve").rglob("*.py"))
        if (lines := _model_type_tests(p))
    }
    assert set(found) == {"metalserve/executor/models/families.py"}, found


def test_the_loader_imports_nothing_from_the_executor() -> None:
    for path in sorted((ROOT / "metalserve" / "loader").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("metalserve.executor"), (path.name, node.module)
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("metalserve.executor") for a in node.names), path.name
