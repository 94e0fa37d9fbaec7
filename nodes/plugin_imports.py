"""A dry pass over a plugin's imports: every module its import-time code asks for that cannot be found.

When a pack fails to import for a missing module, Python names only the first one. This pass reads the
pack's source instead of running it: from its `__init__.py` (or its single file) it follows the imports
that run at import time (module and class bodies, `if` and `with` blocks; not function bodies, not
imports guarded by a `try` that catches ImportError, not `if TYPE_CHECKING:` blocks) into the pack's own
modules, by relative import or by the pack's own name, and checks every other module with import
machinery that runs no code: a top-level module is looked up on sys.path, and a submodule only below a
package already imported (or below one of Weft's compatibility modules, which are safe to import).
"""
from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from typing import Iterable

OPTIONAL_IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}
MAX_FILES = 400  # a pack's own files read at most


def missing_modules(plugin_path: str | Path, own_names: Iterable[str], compat_dir: Path) -> list[str]:
    """Modules the plugin at `plugin_path` imports while it loads and that cannot be found, in the order met.

    `own_names` are the top-level names the pack answers to (its module name and alias); `compat_dir`
    holds Weft's compatibility modules."""
    path = Path(plugin_path)
    root = path if path.is_dir() else path.parent
    start = path / "__init__.py" if path.is_dir() else path
    owners = {name for name in own_names if name}
    missing: list[str] = []
    seen_files: set[Path] = set()
    queue: list[tuple[Path, tuple[str, ...]]] = [(start, ())]  # (file, its package inside the pack)
    while queue and len(seen_files) < MAX_FILES:
        file, package = queue.pop(0)
        if file in seen_files or not file.is_file():
            continue
        seen_files.add(file)
        try:
            tree = ast.parse(file.read_text(encoding="utf-8", errors="replace"), filename=str(file))
        except (SyntaxError, ValueError):
            continue
        for module, names, level in _import_time_imports(tree):
            if level:
                base = package[: len(package) - (level - 1)] if level - 1 <= len(package) else None
                if base is None or not path.is_dir():
                    continue
                inner = (*base, *module.split(".")) if module else base
                _queue_own(root, inner, names, queue)
                continue
            parts = module.split(".")
            own_top = next((o for o in owners if module == o or module.startswith(o + ".")), None)
            if own_top is not None:
                inner = tuple(module[len(own_top):].lstrip(".").split(".")) if module != own_top else ()
                _queue_own(root, tuple(p for p in inner if p), names, queue)
                continue
            absent = _first_absent(parts, compat_dir)
            if absent is None and names:
                absent = _absent_submodules(module, names, compat_dir)
            if absent is not None and absent not in missing:
                missing.append(absent)
    return missing


def comfyui_only_imports(plugin_path: str | Path, own_names: Iterable[str], names: Iterable[str]) -> list[str]:
    """Which of `names` (top-level modules Weft has under the same name as a ComfyUI module of other
    contents, such as `execution`) the plugin imports whole while it loads, following its own modules."""
    path = Path(plugin_path)
    root = path if path.is_dir() else path.parent
    wanted, owners = set(names), {name for name in own_names if name}
    found: list[str] = []
    seen: set[Path] = set()
    queue: list[tuple[Path, tuple[str, ...]]] = [(path / "__init__.py" if path.is_dir() else path, ())]
    while queue and len(seen) < MAX_FILES:
        file, package = queue.pop(0)
        if file in seen or not file.is_file():
            continue
        seen.add(file)
        try:
            tree = ast.parse(file.read_text(encoding="utf-8", errors="replace"), filename=str(file))
        except (SyntaxError, ValueError):
            continue
        for module, imported, level in _import_time_imports(tree):
            own_top = next((o for o in owners if module == o or module.startswith(o + ".")), None)
            if level and path.is_dir():
                base = package[: len(package) - (level - 1)] if level - 1 <= len(package) else None
                if base is not None:
                    _queue_own(root, (*base, *module.split(".")) if module else base, imported, queue)
            elif own_top is not None:
                inner = tuple(p for p in module[len(own_top):].lstrip(".").split(".") if p)
                _queue_own(root, inner, imported, queue)
            elif not level and not imported and module.split(".")[0] in wanted and module not in found:
                found.append(module.split(".")[0])
    return found


def _queue_own(root: Path, inner: tuple[str, ...], names: list[str], queue: list) -> None:
    """Queue the pack's own module `inner` (and any submodules among `names`)."""
    targets = [inner] + [(*inner, name) for name in names if name != "*"]
    for target in targets:
        folder = root.joinpath(*target)
        if (folder / "__init__.py").is_file():
            queue.append((folder / "__init__.py", target))
        elif target and folder.with_suffix(".py").is_file():
            queue.append((folder.with_suffix(".py"), target[:-1]))


def _import_time_imports(tree: ast.Module) -> list[tuple[str, list[str], int]]:
    """(module, imported names, relative level) of the imports that run when the module is imported."""
    found: list[tuple[str, list[str], int]] = []

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.Import):
                found.extend((alias.name, [], 0) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                found.append((node.module or "", [alias.name for alias in node.names], node.level))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            elif isinstance(node, ast.ClassDef):
                visit(node.body)
            elif isinstance(node, ast.If):
                if not _is_type_checking(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
                if not any(_catches_import_error(handler) for handler in node.handlers):
                    visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)
            elif isinstance(node, (ast.With, ast.AsyncWith, ast.For, ast.AsyncFor, ast.While)):
                visit(node.body)
                visit(getattr(node, "orelse", []))

    visit(tree.body)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any((isinstance(k, ast.Name) and k.id in OPTIONAL_IMPORT_ERRORS)
               or (isinstance(k, ast.Attribute) and k.attr in OPTIONAL_IMPORT_ERRORS) for k in kinds)


def _first_absent(parts: list[str], compat_dir: Path) -> str | None:
    """The first prefix of the dotted module that cannot be found (None: found, or not checkable dry)."""
    for index in range(1, len(parts) + 1):
        name = ".".join(parts[:index])
        if name in sys.modules:
            continue
        if index == 1:
            try:
                spec = importlib.util.find_spec(name)
            except (ImportError, ValueError):
                spec = None
        else:
            parent = sys.modules.get(".".join(parts[: index - 1]))
            search = getattr(parent, "__path__", None)
            if parent is None:
                return None  # its parent package was not imported: finding out would run its code
            if search is None:
                return name  # the parent is a plain module: it has no submodules
            spec = importlib.machinery.PathFinder.find_spec(name, list(search))
        if spec is None:
            return name
        if _is_compat(spec, compat_dir):
            importlib.import_module(name)  # Weft's own compatibility module: safe to import
        elif index < len(parts):
            return None  # an installed package not imported yet: its submodules are not checked
    return None


def _absent_submodules(module: str, names: list[str], compat_dir: Path) -> str | None:
    """For `from package import name` below a compatibility package: a name that is neither an attribute
    nor a submodule is reported as the missing submodule it would have to be."""
    package = sys.modules.get(module)
    search = getattr(package, "__path__", None)
    if package is None or search is None or not _is_compat(package.__spec__, compat_dir):
        return None
    for name in names:
        if name == "*" or hasattr(package, name):
            continue
        if importlib.machinery.PathFinder.find_spec(f"{module}.{name}", list(search)) is None:
            return f"{module}.{name}"
    return None


def _is_compat(spec, compat_dir: Path) -> bool:
    origin = getattr(spec, "origin", None)
    if not origin:
        return False
    try:
        Path(origin).resolve().relative_to(compat_dir.resolve())
    except ValueError:
        return False
    return True
