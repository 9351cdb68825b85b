"""The executor's imports point down: kernels/ and spec_decode/ import nothing from the executor (the
runner calls into them), and the model adapter never imports the host path that builds on it. Imports
inside functions and for type checking count too (tools/import_cycles.py --lazy)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _graph() -> dict[str, set[str]]:
    spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "tools" / "import_cycles.py")
    assert spec is not None and spec.loader is not None
    tool: ModuleType = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    graph: dict[str, set[str]] = tool.import_graph(lazy=True)
    return graph


def _edges(graph: dict[str, set[str]], source: str, target: str) -> list[tuple[str, str]]:
    """Imports from modules under `source` of modules under `target`."""
    return sorted(
        (module, imported)
        for module, imports in graph.items()
        if module == source or module.startswith(source + ".")
        for imported in imports
        if imported == target or imported.startswith(target + ".")
    )


def test_kernels_and_spec_decode_import_nothing_from_the_executor() -> None:
    graph = _graph()
    assert _edges(graph, "metalserve.kernels", "metalserve.executor") == []
    assert _edges(graph, "metalserve.spec_decode", "metalserve.executor") == []
    # The edge the other way exists (the runner verifies and proposes drafts), so the test can fail.
    assert _edges(graph, "metalserve.executor.runner", "metalserve.spec_decode")


def test_the_adapter_does_not_import_the_host_path() -> None:
    graph = _graph()
    assert _edges(graph, "metalserve.executor.models", "metalserve.executor.host") == []
    assert _edges(graph, "metalserve.executor.host", "metalserve.executor.models.adapter")
