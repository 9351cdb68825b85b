"""No import cycles between metalserve's modules, counting imports made only for type checking
(tools/import_cycles.py prints them: `python tools/import_cycles.py`)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "tools" / "import_cycles.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_package_has_no_import_cycle() -> None:
    tool = _tool()
    graph = tool.import_graph()
    assert "metalserve.executor.models.families" in graph["metalserve.executor.models.adapter"]
    assert tool.cycles(graph) == []
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "import_cycles.py")], capture_output=True, text=True)
    assert result.returncode == 0 and "0 cycle(s)" in result.stdout, result.stdout


def test_a_type_checking_import_closes_a_cycle(tmp_path: Path) -> None:
    package = tmp_path / "metalserve"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from metalserve.b import B\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from metalserve.a import A\nB = 1\n"
    )
    (package / "c.py").write_text("def f():\n    from metalserve import a\n")
    tool = _tool()
    assert tool.cycles(tool.import_graph(tmp_path)) == [["metalserve.a", "metalserve.b"]]
    (package / "b.py").write_text("B = 1\n")
    (package / "a.py").write_text("from . import c\n")
    (package / "c.py").write_text("def f():\n    from metalserve import a\n")
    assert tool.cycles(tool.import_graph(tmp_path)) == []  # an import inside a function is not counted...
    assert tool.cycles(tool.import_graph(tmp_path, lazy=True)) == [["metalserve.a", "metalserve.c"]]  # ...unless asked


# Edges a lower layer must not have: (importer prefix, imported prefix). The KV manager and the config
# sit below the engine, the distributed stages and speculative decoding; the platform probe below loading.
_DOWNWARD_ONLY = [
    ("metalserve.kvcache", "metalserve.engine"),
    ("metalserve.platform", "metalserve.loader"),
    ("metalserve.config", "metalserve.distributed"),
    ("metalserve.config", "metalserve.spec_decode"),
    # The runner calls into spec_decode and the kernels; the host path builds on the model adapter.
    ("metalserve.kernels", "metalserve.executor"),
    ("metalserve.spec_decode", "metalserve.executor"),
    ("metalserve.executor.models", "metalserve.executor.host"),
]


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_imports_point_down() -> None:
    graph = _tool().import_graph(lazy=True)
    upward = [
        (a, b)
        for a, targets in graph.items()
        for b in targets
        for low, high in _DOWNWARD_ONLY
        if _under(a, low) and _under(b, high)
    ]
    assert upward == []


def test_no_cycle_counting_imports_inside_functions() -> None:
    found = _tool().cycles(_tool().import_graph(lazy=True))
    assert found == []
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "import_cycles.py"), "--lazy"], capture_output=True, text=True
    )
    assert result.returncode == 0 and "0 cycle(s)" in result.stdout, result.stdout
