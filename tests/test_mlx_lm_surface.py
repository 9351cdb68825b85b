"""What metalserve reads from mlx-lm by name, collected from the code, exists in the installed mlx-lm.

pyproject.toml bounds mlx-lm below its next minor; before raising the bound, this test says by name
which module attribute a newer mlx-lm renamed or dropped, instead of a model failing at load or serve.
"""

from __future__ import annotations

import ast
import importlib
import re
import warnings
from importlib.metadata import version
from pathlib import Path

from packaging.requirements import Requirement
from setuptools.config.pyprojecttoml import read_configuration

from metalserve.executor.models.families import SUPPORTED_MODEL_TYPES, VISION_MODEL_TYPES
from metalserve.loader.build import _MLX_LM_MODULES

ROOT = Path(__file__).resolve().parents[1]
DOTTED = re.compile(r"^mlx_lm(\.\w+)+$")


def _reads(path: Path) -> set[tuple[str, str, str]]:
    """(module, attribute, where) for each mlx-lm name the file reads: `from mlx_lm.m import a`, `alias.a`
    on a module imported so, and class paths written as strings ("mlx_lm.models.llama.MLP")."""
    tree = ast.parse(path.read_text())
    where = str(path.relative_to(ROOT))
    found: set[tuple[str, str, str]] = set()
    aliases: dict[str, str] = {}  # local name -> the mlx-lm module it names
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "mlx_lm":
            for alias in node.names:
                found.add((node.module, alias.name, f"{where}:{node.lineno}"))
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and DOTTED.match(node.value):
            module, _, attr = node.value.rpartition(".")
            found.add((module, attr, f"{where}:{node.lineno}"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            found.add((aliases[node.value.id], node.attr, f"{where}:{node.lineno}"))
    return found


def mlx_lm_surface() -> set[tuple[str, str, str]]:
    """Every (module, attribute, where) metalserve reads from mlx-lm, plus each served type's classes."""
    surface = set().union(*(_reads(p) for p in sorted((ROOT / "metalserve").rglob("*.py"))))
    for model_type in SUPPORTED_MODEL_TYPES:
        where = f"model type {model_type}"
        if model_type in VISION_MODEL_TYPES:  # built by mlx-vlm (loader/vision.py), which names its config so
            surface |= {
                (f"mlx_vlm.models.{model_type}", "Model", where),
                (f"mlx_vlm.models.{model_type}", "ModelConfig", where),
            }
            continue
        module = f"mlx_lm.models.{_MLX_LM_MODULES.get(model_type, model_type)}"
        surface |= {(module, "Model", f"model type {model_type}"), (module, "ModelArgs", f"model type {model_type}")}
    return surface


def missing(surface: set[tuple[str, str, str]]) -> list[str]:
    out = []
    for module_name, attr, where in sorted(surface):
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            out.append(f"{module_name} cannot be imported ({exc}), read at {where}")
            continue
        if not hasattr(module, attr):
            try:  # `from mlx_lm.models import rope_utils`: a submodule not yet imported
                importlib.import_module(f"{module_name}.{attr}")
            except ImportError:
                out.append(f"{module_name}.{attr} is missing, read at {where}")
    return out


def test_every_mlx_lm_name_metalserve_reads_exists() -> None:
    surface = mlx_lm_surface()
    names = {f"{m}.{a}" for m, a, _ in surface}
    # The collection itself works: names from each kind of read are in it.
    assert {
        "mlx_lm.models.cache.ArraysCache",
        "mlx_lm.models.llama.TransformerBlock",
        "mlx_lm.models.rope_utils.DynamicNTKScalingRoPE",
        "mlx_lm.models.gemma3_text.ModelArgs",
    } <= names
    problems = missing(surface)
    assert not problems, f"mlx-lm {version('mlx-lm')} lacks what metalserve reads:\n" + "\n".join(problems)


def test_a_renamed_attribute_is_named() -> None:
    fake = {("mlx_lm.models.cache", "NoSuchCache", "x.py:1"), ("mlx_lm.models.no_such_family", "Model", "y")}
    assert missing(fake) == [
        "mlx_lm.models.cache.NoSuchCache is missing, read at x.py:1",
        "mlx_lm.models.no_such_family cannot be imported (No module named 'mlx_lm.models.no_such_family'), read at y",
    ]


def test_mlx_lm_is_bounded_below_its_next_minor() -> None:
    with warnings.catch_warnings():  # setuptools calls its [tool.setuptools] table beta
        warnings.simplefilter("ignore")
        deps = read_configuration(ROOT / "pyproject.toml")["project"]["dependencies"]
    (req,) = [Requirement(d) for d in deps if Requirement(d).name == "mlx-lm"]
    installed = version("mlx-lm")
    major, minor = (int(x) for x in installed.split(".")[:2])
    assert req.specifier.contains(installed)
    assert not req.specifier.contains(f"{major}.{minor + 1}.0")
