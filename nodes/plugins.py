"""The custom-node plugin loader: import node packs from `custom_nodes/` folders, never letting one break the rest.

A plugin is a package (a folder with `__init__.py`) or a single `.py` module in a custom-nodes folder.
It is imported as `custom_nodes.<name>` and, as ComfyUI allows, also answers to its own folder name
(`import <name>.sub` inside the pack), unless that name is not an identifier or is taken by Weft's
own top-level modules or another importable module (an installed copy of the same pack, with the same
`__init__.py`, does not count): then only the alias is refused, with a warning.
It may expose:

- `NODE_CLASS_MAPPINGS` (with optional `NODE_DISPLAY_NAME_MAPPINGS`): classic ComfyUI node classes,
  adapted into NodeSpecs by `nodes.classic.specs_from_mappings` (a V3 class there by `nodes/v3.py`);
- `comfy_entrypoint()`, read only when there are no mappings (as ComfyUI does): ComfyUI's V3
  extension, whose `get_node_list()` classes `nodes/v3.py` adapts;
- `weft_nodes()`: an entry function taking no arguments and returning a list of `NodeSpec`
  (Weft's own declaration, the same data built-in packs use; import Weft inside the function so the
  pack still imports in ComfyUI, which ignores it);
- `WEB_DIRECTORY`: a folder (relative to the plugin's folder, and confined to it) whose `.js` files the
  editor loads from `/extensions/<name>/...`.

Every node a plugin declares carries `python_module = "custom_nodes.<name>"`. A plugin's nodes are
registered together or not at all: a syntax error, a missing module, an exception while importing or
while its nodes are declared, a node refused by the registry's checks, or a node id that is already
taken (unless overriding is allowed) skips the whole plugin with one log line naming it and the
reason, and start-up continues. Each plugin's import time is measured. While plugins import and run,
`nodes/compat/` is on `sys.path`, providing the ComfyUI modules packs use that Weft can answer
truthfully (`COMPAT_MODULES`, with the V3 node API `comfy_api.latest` and its version names;
`server.PromptServer.instance` is the runtime's `nodes.pack_server.PackServer`, of whose routes and
prompt handlers a failed plugin leaves none); any other ComfyUI module is absent, so a pack importing
it fails, naming every missing module a dry pass over its imports finds (`nodes/plugin_imports.py`).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.abc
import importlib.util
import keyword
import logging
import sys
import time
import traceback
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping
from urllib.parse import quote

from execution import isolation
from execution.paths import UnsafePathError, confine
from nodes.classic import specs_from_mappings
from nodes.plugin_imports import comfyui_only_imports, missing_modules
from nodes.v3 import specs_from_entrypoint
from nodes.registry import NodeRegistry
from execution.spec import NodeDefinitionError, NodeSpec

if TYPE_CHECKING:  # imported where used: the flag parsers import this module, and aiohttp is heavy
    from nodes.pack_server import PackServer

logger = logging.getLogger(__name__)

PACKAGE = "custom_nodes"  # the parent module name every plugin is imported under
ENTRY_FUNCTION = "weft_nodes"
V3_ENTRY_FUNCTION = "comfy_entrypoint"
COMPAT_DIR = Path(__file__).resolve().parent / "compat"
COMPAT_MODULES = ("folder_paths", "comfy.utils", "comfy.model_management", "comfy.model_detection",
                  "comfy.supported_models", "comfy.comfy_types", "comfy.k_diffusion.utils", "node_helpers",
                  "server", "protocol", "latent_preview", "comfy_api", "comfy_execution.graph_utils",
                  "comfy_execution.graph")
# Top-level names Weft's own packages hold that ComfyUI uses for a module of other contents: a pack
# importing one whole is refused at load time, not left to fail at run time.
COMFYUI_ONLY_MODULES = ("execution",)
SLOW_IMPORT_SECONDS = 1.0  # imports slower than this are logged as slow (every time is reported anyway)
DISABLED_SUFFIX = ".disabled"  # ComfyUI's convention: `pack.disabled` is skipped
WEFT_ROOT = Path(__file__).resolve().parents[1]
# alias -> the plugin module it stands for, so a re-load may replace its own alias and nothing else
_ALIASES: dict[str, str] = {}


@dataclass
class PluginReport:
    """What happened to one plugin at start-up (plain data: the server lists it, tests read it)."""

    name: str
    path: Path
    status: str  # loaded | failed | disabled
    reason: str = ""  # why it failed or is disabled; empty when loaded
    import_seconds: float = 0.0  # time spent importing the module (0 when not imported)
    node_ids: tuple[str, ...] = ()  # registered node ids, in declaration order
    web_directory: Path | None = None  # served at /extensions/<name>/ when loaded
    module: str = ""  # the Python module name, e.g. custom_nodes.my_pack
    alias: str = ""  # the pack's own top-level name it also answers to, e.g. my_pack (empty when refused)
    warnings: list[str] = field(default_factory=list)  # problems that did not stop the plugin
    slow: bool = False  # import took longer than the slow-import threshold
    declared_ids: tuple[str, ...] = ()  # NODE_CLASS_MAPPINGS keys, when the import got that far
    _source_text: str | None = field(default=None, init=False, repr=False, compare=False)

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (paths as strings)."""
        return {
            "name": self.name, "path": str(self.path), "status": self.status, "reason": self.reason,
            "import_seconds": round(self.import_seconds, 4), "node_ids": list(self.node_ids),
            "web_directory": str(self.web_directory) if self.web_directory else None,
            "module": self.module, "alias": self.alias, "warnings": list(self.warnings), "slow": self.slow,
        }

    def may_provide(self, node_id: str) -> bool:
        """Whether this plugin declares `node_id`: a mapping key it got as far as reading, or the id
        written as a quoted string in its Python source (how a pack that failed to import is traced)."""
        if node_id in self.declared_ids:
            return True
        if self._source_text is None:
            self._source_text = _read_sources(self.path)
        return f'"{node_id}"' in self._source_text or f"'{node_id}'" in self._source_text


SOURCE_SCAN_FILES = 400  # a failed pack's .py files read at most when tracing a missing node id
SOURCE_SCAN_BYTES = 2_000_000  # and at most this much of each


def _read_sources(path: Path) -> str:
    files = [path] if path.is_file() else sorted(path.rglob("*.py"))[:SOURCE_SCAN_FILES]
    texts = []
    for file in files:
        try:
            with open(file, encoding="utf-8", errors="replace") as handle:
                texts.append(handle.read(SOURCE_SCAN_BYTES))
        except OSError:
            continue
    return "\n".join(texts)


class PluginError(Exception):
    """Internal: one plugin could not be loaded; the message is the reason reported."""


# ---------------------------------------------------------------------- discovery
def discover(directory: str | Path) -> list[tuple[str, Path]]:
    """(name, path) of every plugin candidate in `directory`, sorted by name.

    Packages (folders) and `.py` files count; hidden entries and `__pycache__` do not. Folders named
    `*.disabled` are returned too (the loader reports them as disabled)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        if entry.name.startswith((".", "__")):
            continue
        if entry.is_dir():
            found.append((entry.name.removesuffix(DISABLED_SUFFIX), entry))
        elif entry.is_file() and entry.suffix == ".py":
            found.append((entry.stem, entry))
        elif entry.is_file() and entry.name.endswith(".py" + DISABLED_SUFFIX):
            found.append((entry.name[: -len(DISABLED_SUFFIX)], entry))
    return sorted(found, key=lambda item: item[0].lower())


# ---------------------------------------------------------------------- one file, one module
class _AliasLoader(importlib.abc.Loader):
    """Loads `<alias>.<sub>` as the module `custom_nodes.<name>.<sub>` itself (importing it if needed)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._own_spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # The import system stamped the alias's spec on the module; the module keeps its own.
        module.__spec__ = self._own_spec


class _AliasFinder(importlib.abc.MetaPathFinder):
    """A pack's submodules reached by its folder name are the ones reached relatively: one file, one
    module object, as with an installed package (the pack's top module is registered under both names
    by `_import`)."""

    def find_spec(self, fullname, path=None, target=None):
        top, dot, rest = fullname.partition(".")
        if not dot or top not in _ALIASES:
            return None
        canonical = f"{_ALIASES[top]}.{rest}"
        try:
            found = importlib.util.find_spec(canonical)  # its parent is imported already: runs no pack code
        except (ImportError, ValueError):
            found = None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(canonical)) if found else None


_ALIAS_FINDER = _AliasFinder()


# ---------------------------------------------------------------------- the compatibility layer
def enable_compat() -> None:
    """Put `nodes/compat/` first on sys.path, once: plugins import ComfyUI helper modules at run time too."""
    isolation.protect()  # Weft's own names resolve to Weft whatever packs do to sys.path
    if _ALIAS_FINDER not in sys.meta_path:
        sys.meta_path.insert(1, _ALIAS_FINDER)
    compat = str(COMPAT_DIR)
    if compat not in sys.path:
        sys.path.insert(0, compat)


def _ensure_parent_package() -> None:
    # Plugins are imported as custom_nodes.<name>; relative imports inside a package need the parent
    # in sys.modules. It searches no folder itself: each plugin is loaded from its own path.
    if PACKAGE not in sys.modules:
        parent = types.ModuleType(PACKAGE)
        parent.__path__ = []
        parent.__doc__ = "Weft's parent module for custom-node plugins."
        sys.modules[PACKAGE] = parent


def module_name_for(name: str) -> str:
    """The module name a plugin is imported as (dots would split it into a hierarchy, so they go)."""
    return f"{PACKAGE}.{name.replace('.', '_')}"


def _forget_module(module_name: str) -> None:
    for alias in [a for a, target in _ALIASES.items() if target == module_name]:
        del _ALIASES[alias]
        _forget_module(alias)
    for key in [k for k in sys.modules if k == module_name or k.startswith(module_name + ".")]:
        del sys.modules[key]


def _weft_top_level_names() -> set[str]:
    """Names of Weft's own top-level folders and modules (a pack alias must not shadow them)."""
    return {entry.name if entry.is_dir() else entry.stem for entry in WEFT_ROOT.iterdir()
            if not entry.name.startswith((".", "_")) and (entry.is_dir() or entry.suffix == ".py")}


def alias_refusal(name: str, module_name: str, plugin_root: Path) -> str | None:
    """Why the plugin `name` may not also be registered under that top-level name, or None when it may."""
    if not name.isidentifier() or keyword.iskeyword(name):
        return f"its name {name!r} is not a Python identifier, so `import {name}` could never work"
    if name in _weft_top_level_names() or name == PACKAGE:
        return f"the name {name!r} is one of Weft's own top-level modules"
    if _ALIASES.get(name, module_name) != module_name:
        return f"the name {name!r} already stands for the plugin module {_ALIASES[name]}"
    if name in _ALIASES:
        return None  # this plugin's own alias from an earlier load
    if name in sys.modules:
        return f"a module named {name!r} is already imported"
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        found = None
    if found is not None and found.origin:
        try:
            Path(found.origin).resolve().relative_to(plugin_root)
        except (ValueError, OSError):
            if not _same_pack(Path(found.origin), plugin_root):
                return f"an installed module named {name!r} exists ({found.origin})"
    return None


def _same_pack(installed: Path, plugin_root: Path) -> bool:
    """Whether an installed package is a copy of this very pack (the same `__init__.py`, byte for byte):
    a pack installed with pip as well as copied into custom_nodes. Its alias then names the copy
    being loaded, which is the same code."""
    own = plugin_root / "__init__.py"
    if installed.name != "__init__.py" or not own.is_file():
        return False
    try:
        return installed.read_bytes() == own.read_bytes()
    except OSError:
        return False


# ---------------------------------------------------------------------- one plugin
def _where(exc: BaseException, plugin_root: Path) -> str:
    """' (file:line)' of the deepest traceback frame inside the plugin, or ''."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        try:
            relative = Path(frame.filename).resolve().relative_to(plugin_root)
        except (ValueError, OSError):
            continue
        return f" ({relative.as_posix()}:{frame.lineno})"
    return ""


def _missing_reason(exc: ModuleNotFoundError, path: Path, own_names: tuple[str, ...]) -> str:
    """'missing module(s) ...': the one the import stopped at, and every other the dry pass finds."""
    try:
        found = missing_modules(path, own_names, COMPAT_DIR)
    except Exception:  # the dry pass is a courtesy: the import's own failure is still reported
        logger.debug("dry import pass over %s failed", path, exc_info=True)
        found = []
    names = [exc.name] + [name for name in found if name != exc.name]
    if len(names) == 1:
        return f"missing module '{exc.name}'"
    return f"missing modules {', '.join(repr(n) for n in names)} (the import stopped at '{exc.name}')"


def _also_missing(path: Path, own_names: tuple[str, ...], besides: str = "") -> str:
    """'; missing modules also: ...' for what the dry pass finds missing beyond `besides`, or ''."""
    try:
        found = [name for name in missing_modules(path, own_names, COMPAT_DIR) if name != besides]
    except Exception:  # the dry pass is a courtesy
        logger.debug("dry import pass over %s failed", path, exc_info=True)
        return ""
    return f"; missing modules also: {', '.join(repr(n) for n in found)}" if found else ""


def _import_reason(exc: BaseException, plugin_root: Path, path: Path | None = None,
                   own_names: tuple[str, ...] = ()) -> str:
    if isinstance(exc, SyntaxError):
        try:
            file = Path(exc.filename).resolve().relative_to(plugin_root).as_posix()
        except (TypeError, ValueError, OSError):
            file = exc.filename or "?"
        return f"syntax error: {exc.msg} ({file}:{exc.lineno})"
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        hint = ""
        top = exc.name.split(".")[0]
        if top in ("comfy", "comfy_extras", "comfy_api", "server", "nodes", "execution", "latent_preview"):
            hint = f"; Weft's compatibility layer provides only {', '.join(COMPAT_MODULES)}"
        missing = _missing_reason(exc, path, own_names) if path is not None else f"missing module '{exc.name}'"
        return f"{missing}{hint}{_where(exc, plugin_root)}"
    if isinstance(exc, ImportError):
        hint = ""
        if exc.name in ("nodes", "execution"):
            hint = f"; Weft's `{exc.name}` is its own package, not ComfyUI's {exc.name}.py"
        elif exc.name in COMPAT_MODULES:
            hint = f"; Weft's {exc.name} provides only what docs/custom-nodes.md lists"
        also = _also_missing(path, own_names) if path is not None else ""
        return f"import error: {exc}{hint}{also}{_where(exc, plugin_root)}"
    if isinstance(exc, SystemExit):
        return f"called sys.exit({exc.code!r}) while importing{_where(exc, plugin_root)}"
    return f"{type(exc).__name__} while importing: {exc}{_where(exc, plugin_root)}"


def _import(path: Path, module_name: str, alias: str = "", warnings: list[str] | None = None) -> types.ModuleType:
    if path.is_dir():
        init = path / "__init__.py"
        if not init.is_file():
            raise PluginError("folder has no __init__.py, so it is not a Python package")
        spec = importlib.util.spec_from_file_location(module_name, init, submodule_search_locations=[str(path)])
    else:
        spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise PluginError(f"cannot create an import spec for {path}")
    module = importlib.util.module_from_spec(spec)
    _forget_module(module_name)  # a re-load starts clean, submodules and alias included
    sys.modules[module_name] = module
    if alias:
        # Before the pack's code runs: its __init__ may import its own submodules by name.
        _ALIASES[alias] = module_name
        sys.modules[alias] = module
    guard = isolation.ModuleGuard()
    try:
        with guard:
            spec.loader.exec_module(module)
    except BaseException:
        _forget_module(module_name)
        raise
    finally:
        if guard.restored and warnings is not None:
            warnings.append(f"it changed how Weft's own modules resolve; put back: {', '.join(guard.restored)}")
    return module


def _collect_specs(module: types.ModuleType, module_name: str, plugin_root: Path,
                   refused: list[tuple[str, str]]) -> list[NodeSpec]:
    """The pack's node specs; a node that cannot be declared goes to `refused` (its id and reason) instead."""
    specs: list[NodeSpec] = []
    mappings = getattr(module, "NODE_CLASS_MAPPINGS", None)
    entry = getattr(module, ENTRY_FUNCTION, None)
    if mappings is not None:
        display = getattr(module, "NODE_DISPLAY_NAME_MAPPINGS", None)
        if display is not None and not isinstance(display, dict):
            raise PluginError(f"NODE_DISPLAY_NAME_MAPPINGS must be a dict, got {type(display).__name__}")
        try:
            specs.extend(specs_from_mappings(mappings, display, python_module=module_name, refused=refused))
        except NodeDefinitionError as exc:
            raise PluginError(f"node refused: {exc}") from exc
        except Exception as exc:  # a class whose attributes break the adapter in some other way
            raise PluginError(f"{type(exc).__name__} while declaring nodes: {exc}{_where(exc, plugin_root)}") from exc
    elif hasattr(module, V3_ENTRY_FUNCTION):
        try:
            specs.extend(specs_from_entrypoint(getattr(module, V3_ENTRY_FUNCTION), python_module=module_name))
        except NodeDefinitionError as exc:
            raise PluginError(f"node refused: {exc}") from exc
        except Exception as exc:
            raise PluginError(f"{V3_ENTRY_FUNCTION}() raised {type(exc).__name__}: {exc}"
                              f"{_where(exc, plugin_root)}") from exc
    if entry is not None:
        if not callable(entry):
            raise PluginError(f"{ENTRY_FUNCTION} must be a function returning a list of NodeSpec")
        try:
            declared = entry()
        except NodeDefinitionError as exc:
            raise PluginError(f"node refused: {exc}") from exc
        except Exception as exc:
            raise PluginError(f"{ENTRY_FUNCTION}() raised {type(exc).__name__}: {exc}{_where(exc, plugin_root)}") from exc
        if not isinstance(declared, (list, tuple)):
            raise PluginError(f"{ENTRY_FUNCTION}() must return a list of NodeSpec, got {type(declared).__name__}")
        for index, spec in enumerate(declared):
            if not isinstance(spec, NodeSpec):
                raise PluginError(f"{ENTRY_FUNCTION}() item {index} is a {type(spec).__name__}, not a NodeSpec")
            try:
                # A copy: the plugin's own objects stay as declared; /object_info names the plugin.
                specs.append(dataclasses.replace(spec, python_module=module_name))
            except NodeDefinitionError as exc:
                raise PluginError(f"node refused: {exc}") from exc
    return specs


def _web_directory(module: types.ModuleType, path: Path, report: PluginReport) -> Path | None:
    declared = getattr(module, "WEB_DIRECTORY", None)
    if declared is None:
        return None
    if not isinstance(declared, str) or not declared.strip():
        raise PluginError(f"WEB_DIRECTORY must be a non-empty string, got {declared!r}")
    plugin_dir = path if path.is_dir() else path.parent
    relative = declared
    if Path(declared).is_absolute():  # `os.path.join(os.path.dirname(__file__), "web")`: fine when inside
        try:
            relative = Path(declared).resolve().relative_to(plugin_dir.resolve()).as_posix()
        except (ValueError, OSError):
            raise PluginError(f"WEB_DIRECTORY {declared!r} is outside the plugin's folder") from None
    try:
        web = confine(plugin_dir, relative.replace("\\", "/").removeprefix("./") or ".")
    except UnsafePathError as exc:
        raise PluginError(f"WEB_DIRECTORY {declared!r} is outside the plugin's folder: {exc}") from exc
    if not web.is_dir():
        report.warnings.append(f"WEB_DIRECTORY {declared!r} is not a folder; no editor extensions served")
        return None
    return web


def load_plugin(registry: NodeRegistry, path: str | Path, *, name: str | None = None,
                allow_override: bool = False, slow_import_seconds: float = SLOW_IMPORT_SECONDS) -> PluginReport:
    """Import one plugin and register its nodes atomically; never raises for the plugin's own faults."""
    path = Path(path).resolve()
    name = name or (path.stem if path.is_file() else path.name)
    module_name = module_name_for(name)
    report = PluginReport(name=name, path=path, status="failed", module=module_name)
    enable_compat()
    _ensure_parent_package()
    plugin_root = path if path.is_dir() else path.parent
    refused = alias_refusal(name, module_name, path)
    if refused is None:
        report.alias = name
    else:
        report.warnings.append(f"not importable as '{name}' (only as {module_name}): {refused}")
    started = time.perf_counter()
    from nodes import pack_server

    server_mark = pack_server.installed().mark()  # the routes and prompt handlers it adds go if it fails
    refused: list[tuple[str, str]] = []
    try:
        try:
            module = _import(path, module_name, report.alias, report.warnings)
        except PluginError:
            raise
        except (Exception, SystemExit) as exc:
            logger.debug("plugin %s import traceback", name, exc_info=exc)
            own_names = (module_name, report.alias) if report.alias else (module_name,)
            raise PluginError(_import_reason(exc, plugin_root, path, own_names)) from exc
        finally:
            report.import_seconds = time.perf_counter() - started
        report.slow = report.import_seconds >= slow_import_seconds
        own_names = (module_name, report.alias) if report.alias else (module_name,)
        comfyui_only = comfyui_only_imports(path, own_names, COMFYUI_ONLY_MODULES)
        for name in comfyui_only[:1]:
            raise PluginError(f"it imports ComfyUI's `{name}` module, which Weft does not provide (Weft's "
                              f"`{name}` is its own package){_also_missing(path, own_names)}")
        mappings = getattr(module, "NODE_CLASS_MAPPINGS", None)
        if isinstance(mappings, dict):
            report.declared_ids = tuple(str(key) for key in mappings)
        web = _web_directory(module, path, report)
        specs = _collect_specs(module, module_name, plugin_root, refused)
        if refused and not specs and web is None:
            raise PluginError(f"node refused: {'; '.join(reason for _, reason in refused)}")
        if not specs and web is None:
            hint = ""
            if hasattr(module, "NODES"):
                hint = f"; a NODES list is how built-in packs declare nodes, plugins expose {ENTRY_FUNCTION}()"
            raise PluginError(f"declares no nodes (no NODE_CLASS_MAPPINGS, {V3_ENTRY_FUNCTION}() or {ENTRY_FUNCTION}()) "
                              f"and no WEB_DIRECTORY{hint}")
        replaced = [f"node '{s.node_id}' replaces the one from {registry.origin(s.node_id)}"
                    for s in specs if s.node_id in registry and allow_override]
        taken = [s for s in specs if s.node_id in registry and not allow_override]
        hint = " (start with --allow-node-override to let plugins replace nodes)"
        refused += [(s.node_id, f"node '{s.node_id}' from {module_name}: id already registered by "
                     f"{registry.origin(s.node_id)}{hint}") for s in taken]
        specs = [s for s in specs if s not in taken]
        if not specs and web is None:
            raise PluginError(f"node refused: {'; '.join(reason for _, reason in refused)}")
        try:
            registry.register_all(specs, origin=module_name, override=allow_override)
        except NodeDefinitionError as exc:  # an id the pack itself declares twice
            raise PluginError(f"node refused: {exc}") from exc
        report.warnings.extend(f"node refused: {reason}" for _, reason in refused)
        report.warnings.extend(replaced)
        report.node_ids = tuple(s.node_id for s in specs)
        report.web_directory = web
        report.status = "loaded"
    except PluginError as exc:
        report.reason = str(exc)
        _forget_module(module_name)
    except (Exception, SystemExit) as exc:  # anything else a plugin's code raised while being declared
        logger.debug("plugin %s registration traceback", name, exc_info=exc)
        report.reason = f"{type(exc).__name__} while declaring nodes: {exc}{_where(exc, plugin_root)}"
        _forget_module(module_name)
    if report.status != "loaded":
        report.alias = ""
        pack_server.installed().rollback(server_mark)
        registry.note_failed_source(name, report.reason, report.may_provide)
    elif refused:  # a workflow naming a refused node is told why it is missing
        refused_ids = {node_id for node_id, _ in refused}
        registry.note_failed_source(name, "; ".join(reason for _, reason in refused), refused_ids.__contains__)
    else:
        registry.forget_failed_source(name)
    return report


# ---------------------------------------------------------------------- every plugin
def load_plugins(registry: NodeRegistry, directories: Iterable[str | Path], *, disabled: Iterable[str] = (),
                 disable_all: bool = False, allow_override: bool = False,
                 slow_import_seconds: float = SLOW_IMPORT_SECONDS,
                 server: PackServer | None = None) -> list[PluginReport]:
    """Load every plugin in `directories` (in order, each sorted by name) and log one line per problem.

    `disabled` names plugins (folder name or module file name) to skip; `disable_all` skips all
    of them (still reported, as disabled). A plugin name already loaded from an earlier folder is
    refused, since its module name and extension URL would collide. `server` (the runtime's) becomes
    the PromptServer.instance the plugins see."""
    if server is not None:
        from nodes import pack_server

        pack_server.install(server)
    disabled_names = {d.removesuffix(".py") for d in disabled}
    reports: list[PluginReport] = []
    seen_dirs: set[Path] = set()
    seen_names: dict[str, Path] = {}
    for directory in directories:
        directory = Path(directory).resolve()
        if directory in seen_dirs:
            continue
        seen_dirs.add(directory)
        for name, path in discover(directory):
            report = _load_one(registry, name, path, disabled_names, disable_all, allow_override,
                               slow_import_seconds, seen_names)
            reports.append(report)
            _log(report)
    _log_summary(reports)
    return reports


def _load_one(registry, name, path, disabled_names, disable_all, allow_override, slow_import_seconds,
              seen_names) -> PluginReport:
    module = module_name_for(name)
    if path.name.endswith(DISABLED_SUFFIX):
        return PluginReport(name, path.resolve(), "disabled", f"its name ends with {DISABLED_SUFFIX}", module=module)
    if disable_all:
        return PluginReport(name, path.resolve(), "disabled", "--disable-all-custom-nodes", module=module)
    if name in disabled_names:
        return PluginReport(name, path.resolve(), "disabled", "--disable-custom-node", module=module)
    if module in seen_names:
        return PluginReport(name, path.resolve(), "failed",
                            f"a plugin with the same name was already loaded from {seen_names[module]}", module=module)
    seen_names[module] = path.resolve()
    return load_plugin(registry, path, name=name, allow_override=allow_override,
                       slow_import_seconds=slow_import_seconds)


def _log(report: PluginReport) -> None:
    if report.status == "failed":
        logger.warning("custom node plugin '%s' (%s) not loaded: %s", report.name, report.path, report.reason)
    elif report.status == "disabled":
        logger.info("custom node plugin '%s' disabled (%s)", report.name, report.reason)
    else:
        for warning in report.warnings:
            logger.warning("custom node plugin '%s': %s", report.name, warning)
    if report.slow:
        logger.warning("custom node plugin '%s' took %.2f s to import (slow)", report.name, report.import_seconds)


def _log_summary(reports: list[PluginReport]) -> None:
    imported = [r for r in reports if r.status != "disabled"]
    if not imported:
        return
    lines = ["import times for custom node plugins:"]
    for report in sorted(imported, key=lambda r: -r.import_seconds):
        marker = "" if report.status == "loaded" else " (FAILED)"
        lines.append(f"  {report.import_seconds:8.3f} s  {report.name}{marker}")
    logger.info("\n".join(lines))


# ---------------------------------------------------------------------- command line and runtime
def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """The plugin flags (added to the server's and the headless runner's arguments)."""
    group = parser.add_argument_group("custom nodes")
    group.add_argument("--custom-nodes-directory", action="append", default=[], type=Path, metavar="DIR",
                       help="another folder of custom-node plugins (repeatable; after <base>/custom_nodes)")
    group.add_argument("--disable-all-custom-nodes", action="store_true", help="load no custom-node plugins")
    group.add_argument("--disable-custom-node", action="append", default=[], metavar="NAME",
                       help="skip the plugin with this folder or module name (repeatable)")
    group.add_argument("--allow-node-override", action="store_true",
                       help="let a plugin replace a node id already registered (refused by default)")


def load_from_args(registry: NodeRegistry, base: str | Path, args: argparse.Namespace, *,
                   server: PackServer | None = None) -> list[PluginReport]:
    """Load `<base>/custom_nodes` and every `--custom-nodes-directory`, honouring the disable flags."""
    directories = [Path(base) / "custom_nodes", *getattr(args, "custom_nodes_directory", [])]
    return load_plugins(
        registry, directories, disabled=getattr(args, "disable_custom_node", []),
        disable_all=getattr(args, "disable_all_custom_nodes", False),
        allow_override=getattr(args, "allow_node_override", False), server=server,
    )


def failures(reports: Iterable[PluginReport]) -> list[dict[str, Any]]:
    """`[{name, path, reason, import_seconds}]` of the plugins that failed (for `/system_stats`)."""
    return [{"name": r.name, "path": str(r.path), "reason": r.reason, "import_seconds": round(r.import_seconds, 4)}
            for r in reports if r.status == "failed"]


# ---------------------------------------------------------------------- editor extensions
def web_directories(reports: Iterable[PluginReport]) -> dict[str, Path]:
    """{plugin name: WEB_DIRECTORY} of the loaded plugins that have one."""
    return {r.name: r.web_directory for r in reports if r.status == "loaded" and r.web_directory is not None}


def extension_urls(web_dirs: Mapping[str, Path]) -> list[str]:
    """URLs of every `.js` file under each plugin's web folder: `/extensions/<plugin>/<path>` (for `/extensions`)."""
    urls = []
    for plugin, root in sorted(web_dirs.items()):
        root = Path(root).resolve()
        for path in sorted(root.rglob("*.js")):
            relative = path.relative_to(root).as_posix()
            try:
                confined = confine(root, relative)  # a symlink pointing outside is not listed
            except UnsafePathError:
                continue
            if confined.is_file():
                urls.append(f"/extensions/{quote(plugin)}/{quote(relative)}")
    return urls


def extension_file(web_dirs: Mapping[str, Path], plugin: str, relative_path: str) -> Path:
    """The file for `/extensions/<plugin>/<relative_path>`, confined to that plugin's web folder.

    Raises KeyError for an unknown plugin, `UnsafePathError` (a ValueError) for a path leaving the
    folder, and FileNotFoundError when no such file exists."""
    if plugin not in web_dirs:
        raise KeyError(f"no plugin named {plugin!r} serves editor extensions")
    path = confine(web_dirs[plugin], relative_path)
    if not path.is_file():
        raise FileNotFoundError(f"plugin {plugin!r} has no extension file {relative_path!r}")
    return path
