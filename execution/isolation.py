"""Weft's own module names stay Weft's, whatever a node pack does to `sys.path`, `sys.modules` or `builtins`.

Packs commonly put their own folder first on `sys.path` (`sys.path.insert(0, os.path.dirname(__file__))`,
or a library they import does it). When that folder holds a `nodes/`, `execution/` or `models/` package,
every later `import nodes...` in that process, and every import in a worker process started with the
same `sys.path`, would reach the pack's package instead of Weft's. Three guards keep the names fixed:

- `OwnNamesFinder`, first on `sys.meta_path`, resolves Weft's top-level packages (`OWN_NAMES`) from
  Weft's own folder only, so the order of `sys.path` no longer decides them in this process;
- `own_root_first()` moves Weft's folder to the front of `sys.path` right before a worker process is
  spawned: a spawned child unpickles its entry point (importing `execution.worker`) with the parent's
  `sys.path` before any Weft code can run in it;
- `ModuleGuard`, around each pack's import, puts back any of Weft's modules a pack replaced or added in
  `sys.modules`, the finder if a pack pushed another one in front of it, and `builtins.__import__` if a
  pack swapped it, reporting what it put back.

A pack's own packages named like Weft's (its `nodes/`) are therefore not importable by those names; the
pack sees Weft's, as in ComfyUI, where a pack shadowing the server's `nodes` breaks the server instead.
"""
from __future__ import annotations

import builtins
import importlib.abc
import importlib.machinery
import os
import sys
from pathlib import Path

OWN_ROOT = Path(__file__).resolve().parents[1]
# Weft's importable top-level names. `tests` is left out: a pack's own `tests` package does not reach
# Weft's runtime, and the test suite has imported its own before any pack loads.
OWN_NAMES = frozenset(["main", "web", "execution", "nodes", "models", "media", "kernels", "cluster"])


def _is_own_name(module_name: str) -> bool:
    return module_name.split(".", 1)[0] in OWN_NAMES


class OwnNamesFinder(importlib.abc.MetaPathFinder):
    """Finds Weft's top-level packages in Weft's folder only (their submodules follow their `__path__`)."""

    def find_spec(self, fullname, path=None, target=None):
        if path is not None or fullname not in OWN_NAMES:
            return None
        return importlib.machinery.PathFinder.find_spec(fullname, [str(OWN_ROOT)])


_FINDER = OwnNamesFinder()


def _finder_first() -> bool:
    """Put the finder first on sys.meta_path; True when it had to be moved or added."""
    if sys.meta_path and sys.meta_path[0] is _FINDER:
        return False
    while _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    sys.meta_path.insert(0, _FINDER)
    return True


def own_root_first() -> None:
    """Make Weft's folder the first `sys.path` entry (a spawned worker process starts with this list)."""
    root = str(OWN_ROOT)
    if sys.path and sys.path[0] == root:
        return
    cwd = os.getcwd()
    for entry in list(sys.path):
        try:
            same = Path(entry or cwd).resolve() == OWN_ROOT
        except (OSError, ValueError):
            same = False
        if same:
            sys.path.remove(entry)
    sys.path.insert(0, root)


def protect() -> None:
    """Install both standing guards in this process (idempotent; cheap enough to call before each use)."""
    _finder_first()
    own_root_first()


class ModuleGuard:
    """Around one pack's import: what it changed of Weft's own module resolution is put back.

    `restored` lists, after the block, each thing put back, in words (empty when the pack changed none)."""

    def __init__(self) -> None:
        self.restored: list[str] = []

    def __enter__(self) -> "ModuleGuard":
        protect()
        self._modules = {name: module for name, module in sys.modules.items() if _is_own_name(name)}
        self._import = builtins.__import__
        return self

    def __exit__(self, *exc_info) -> None:
        for name, module in self._modules.items():
            if sys.modules.get(name) is not module:
                sys.modules[name] = module
                self.restored.append(f"sys.modules[{name!r}]")
        for name in [n for n in list(sys.modules) if _is_own_name(n) and n not in self._modules]:
            file = getattr(sys.modules[name], "__file__", None)
            if not _inside_own_root(file):
                del sys.modules[name]  # an own name that is not Weft's file: import Weft's when asked
                self.restored.append(f"sys.modules[{name!r}]")
        if builtins.__import__ is not self._import:
            builtins.__import__ = self._import
            self.restored.append("builtins.__import__")
        if _finder_first():
            self.restored.append("the import finder for Weft's own modules (first on sys.meta_path)")
        own_root_first()


def _inside_own_root(file: str | None) -> bool:
    if not file:
        return False
    try:
        Path(file).resolve().relative_to(OWN_ROOT)
    except (OSError, ValueError):
        return False
    return True
