"""No import circle in the data plane or the operator, function-local imports included: a circle
hidden behind a deferred import is still a circle (issue 46)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = [(ROOT / "services", "tokenline"), (ROOT / "operator", "tokenline_operator")]


def import_graph(base: Path, package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (anywhere in its body)."""
    modules = {}
    for path in (base / package).rglob("*.py"):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    anchor = name.split(".")
                    if path.name != "__init__.py":
                        anchor = anchor[:-1]
                    anchor = anchor[: len(anchor) - node.level + 1]
                    source = ".".join(anchor + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                # `from pkg import mod` names the module; `from mod import name`, the module
                targets = [source, *(f"{source}.{alias.name}" for alias in node.names)]
            else:
                continue
            graph[name].update(t for t in targets if t in graph and t != name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.mark.parametrize(("base", "package"), PACKAGES, ids=[p for _, p in PACKAGES])
def test_no_import_circle(base, package):
    graph = import_graph(base, package)
    assert len(graph) > 20  # the walk found the package
    assert circles(graph) == []


def test_a_circle_is_found_even_behind_a_deferred_import(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text("def later():\n    from pkg.a import x\n")
    (package / "c.py").write_text("from . import a\n")
    assert circles(import_graph(tmp_path, "pkg")) == [["pkg.a", "pkg.b"]]
