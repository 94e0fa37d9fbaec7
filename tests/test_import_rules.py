"""The folder-level import rules ARCHITECTURE.md states: kernels/ imports nothing of Weft; models/ and media/
know nothing of nodes, graphs or HTTP; execution/ sees nodes only through its own NodeSpec; web/ reaches the
rest only through execution/; cluster/ (the worker pools) sits at main's level and may import execution/,
nodes/ and models/ to build a worker's runtime and start a rank group's ranks, but not web/ or main.py."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WEFT = {"execution", "nodes", "models", "media", "kernels", "web", "cluster", "main"}
FORBIDDEN = {
    "kernels": WEFT - {"kernels"},
    "models": {"nodes", "execution", "web", "cluster", "main"},
    "media": {"nodes", "execution", "web", "cluster", "main"},
    "execution": {"torch", "nodes", "models", "media", "kernels", "web", "cluster", "main"},
    "nodes": {"web", "cluster", "main"},
    "web": {"nodes", "models", "media", "kernels", "cluster", "main"},
    "cluster": {"web", "main", "media", "kernels"},
}


def imported_roots(path: Path) -> set[str]:
    """The top-level package of every module `path` imports, at any depth of its code."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_folder_imports_only_what_its_layer_may(folder):
    broken = {str(path.relative_to(ROOT)): sorted(imported_roots(path) & FORBIDDEN[folder])
              for path in sorted((ROOT / folder).rglob("*.py"))}
    assert {path: names for path, names in broken.items() if names} == {}
