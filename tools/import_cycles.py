"""Print the import cycles between metalserve's modules (exit 1 when there is one).

An edge A -> B is any `import` of B (or of a name from B) written at A's module scope, including those under
`if TYPE_CHECKING:`: a type-only edge still ties the two modules together for a reader and for mypy.
Imports inside functions are left out by default, since they are the deliberate way to defer a heavy or
optional dependency; `--lazy` adds them. Importing a package runs its `__init__`, so `from a.b import c`
is an edge to `a.b` (or to `a.b.c` when that is a module) and `a.b` in turn depends on `a`'s `__init__`
only through what that file imports itself.

    python tools/import_cycles.py            # module scope, TYPE_CHECKING included
    python tools/import_cycles.py --lazy     # plus imports inside functions
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "metalserve"


def module_names(root: Path) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, from its __init__)."""
    names = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _scope_imports(tree: ast.Module, lazy: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements at module scope (any depth of if/try/with), plus in functions if `lazy`."""
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) and not lazy:
            continue
        else:
            stack.extend(ast.iter_child_nodes(node))


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names (relative imports resolved against `module`)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(root: Path = ROOT, lazy: bool = False) -> dict[str, set[str]]:
    """module -> the package modules it imports (a name imported from a package counts as its submodule
    when that is a module, else as the package)."""
    modules = module_names(root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in _scope_imports(ast.parse(path.read_text(), str(path)), lazy):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                source = _resolve(name, is_package, node)
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
            for target in targets:
                while target and target not in modules:  # `import a.b.c` where c is a name: a.b
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _shortest_loop(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One shortest loop through the component's first module, to show which imports close it."""
    start = component[0]
    members = set(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & members):
            if w == start:
                return paths[v] + [start]
            if w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    return component


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lazy", action="store_true", help="count imports inside functions too")
    args = parser.parse_args(argv)
    graph = import_graph(lazy=args.lazy)
    found = cycles(graph)
    edges = sum(len(v) for v in graph.values())
    scope = "module scope + TYPE_CHECKING" + (" + inside functions" if args.lazy else "")
    print(f"{len(graph)} modules, {edges} import edges ({scope}); {len(found)} cycle(s)")
    for component in found:
        print(f"- {len(component)} modules: {', '.join(component)}")
        print(f"  e.g. {' -> '.join(_shortest_loop(graph, component))}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
