"""The folder-level import rules ARCHITECTURE.md states: kernels/ imports nothing of Weft; models/ and media/
know nothing of nodes, graphs or HTTP; execution/ sees nodes only through its own NodeSpec; web/ reaches the
rest only through execution/; cluster/ (the worker pools) sits at main's level and may import execution/,
nodes/ and models/ to build a worker's runtime and start a rank group's ranks, but not web/ or main.py. The
quantized formats (models/quant/) sit below the layers (models/ops.py) and the loader: no cycle between them."""
from __future__ import annotations

import ast
import subprocess
import sys
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


# ----------------------------------------------------------------------------------------------
# The model-loading path runs one way: kernels <- models/quant <- models/ops <- models/loading.

def _module_file(name: str) -> Path | None:
    base = ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports_of(name: str) -> set[str]:
    """The Weft modules `name` imports at any depth of its code, with the packages Python runs on the way."""
    path = _module_file(name)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1) if _module_file(".".join(parts[:i])))
    found.discard(name)
    return found


def _reachable(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for module in _imports_of(todo.pop()):
            if module not in seen:
                seen.add(module)
                todo.append(module)
    return seen


def _quant_modules() -> list[str]:
    return sorted(".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                  for path in (ROOT / "models" / "quant").rglob("*.py"))


@pytest.mark.parametrize("module", _quant_modules())
def test_quantized_formats_never_import_the_layers_or_the_loader(module):
    reached = _reachable(module)
    assert not reached & {"models.ops", "models.loading", "models.memory", "models.patcher"}, sorted(reached)
    assert {m for m in reached if m.split(".")[0] not in ("kernels", "models")} == set()


def test_ops_and_the_loader_import_the_formats_one_way():
    assert "models.quant.formats" in _reachable("models.ops")
    assert "models.ops" in _reachable("models.loading") and "models.loading" not in _reachable("models.ops")
    assert "models.ops" not in _reachable("models.ops")  # no cycle through it


def test_kernels_import_nothing_of_weft():
    weft = {"execution", "nodes", "models", "media", "web", "cluster", "main"}
    broken = {str(path.relative_to(ROOT)): sorted(imported_roots(path) & weft)
              for path in sorted((ROOT / "kernels").rglob("*.py"))}
    assert {path: names for path, names in broken.items() if names} == {}


@pytest.mark.parametrize("module", ["models.quant.formats", "models.quant.markers", "models.quant.writer",
                                    "models.ops", "models.loading"])
def test_each_model_loading_module_imports_alone_in_a_fresh_interpreter(module):
    code = (f"import sys, {module}; "
            "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in ('models', 'kernels'))))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    loaded = set(done.stdout.split())
    if module.startswith("models.quant"):
        assert not loaded & {"models.ops", "models.loading"}, sorted(loaded)
    else:
        assert "models.quant.formats" in loaded
