"""ComfyUI's `folder_paths` helper for plugins, answered from Weft's configured folders.

Compatibility layer (on sys.path while plugins load and run; see nodes/plugins.py). Every name is
looked up in the folders of the running job, or of the configured runtime outside a job
(`execution.context.current().paths`). File names from outside go through `confine`. Model lists hold
safetensors files only (a folder kind a pack adds lists the extensions it declares, never a pickle
format): Weft never loads pickle checkpoints.

Provided: get_filename_list, get_full_path, get_full_path_or_raise, get_folder_paths,
add_model_folder_path, get_input_directory, get_output_directory, get_temp_directory,
get_user_directory, get_directory_by_type, get_annotated_filepath, exists_annotated_filepath,
get_save_image_path, filter_files_extensions, filter_files_content_types, supported_pt_extensions,
annotated_filepath, and the attributes base_path, models_dir, input_directory, output_directory,
temp_directory, user_directory (read-only views) and folder_names_and_paths (a live mapping from
model folder name to (folders searched, extensions); assigning an entry adds its folders to that kind's
search, as add_model_folder_path does, and a pack's own kind keeps the extensions it gave; nothing else
writes through it). Not provided: the
set_*_directory functions, cache helpers.
"""
from __future__ import annotations

import mimetypes
import os
from pathlib import Path, PurePosixPath
from collections.abc import Mapping
from typing import Any, Iterable, Iterator

from execution.context import current
from execution.paths import MODEL_EXTENSIONS, MODEL_FOLDERS, UnsafePathError, confine

supported_pt_extensions = frozenset(MODEL_EXTENSIONS)  # safetensors only, by design
# ComfyUI's older folder names, read as the current ones.
_ALIASES = {"clip": "text_encoders", "unet": "diffusion_models"}
_ANNOTATIONS = {" [input]": "input", " [output]": "output", " [temp]": "temp"}


def _paths():
    return current().paths


def _folder_name(folder_name: str) -> str:
    name = _ALIASES.get(folder_name, folder_name)
    if name not in MODEL_FOLDERS and name not in _paths().extra_model_dirs:
        known = sorted({*MODEL_FOLDERS, *_paths().extra_model_dirs, *_ALIASES})
        raise KeyError(f"folder_paths: unknown model folder {folder_name!r}; known: {', '.join(known)}")
    return name


def __getattr__(name: str) -> Any:
    # Module attributes that ComfyUI keeps as globals, read live from the configured folders.
    views = {
        "base_path": lambda p: p.base, "models_dir": lambda p: p.models, "input_directory": lambda p: p.input,
        "output_directory": lambda p: p.output, "temp_directory": lambda p: p.temp,
        "user_directory": lambda p: p.user,
    }
    if name in views:
        return str(views[name](_paths()))
    if name == "folder_names_and_paths":
        return _FolderTable()
    raise AttributeError(f"module 'folder_paths' (Weft compatibility layer) has no attribute {name!r}")


class _FolderTable(Mapping):
    """`folder_names_and_paths` over Weft's folders: {model folder: ([folders searched], {extensions})}.

    Read live on every access. Weft's model kinds list safetensors files only, so their extensions are
    those; assigning `table[name] = (folders, extensions)` adds the folders to that kind's search (the
    kind exists from then on, even with no folders), and a kind of the pack's own lists the extensions
    it gave (the same set object is read back, pickle formats are never listed)."""

    def _names(self) -> list[str]:
        return list(dict.fromkeys([*MODEL_FOLDERS, *_paths().extra_model_dirs, *_ALIASES]))

    def __getitem__(self, folder_name: str) -> tuple[list[str], set[str]]:
        try:
            folders = get_folder_paths(folder_name)
        except KeyError:
            raise KeyError(folder_name) from None
        kind = _ALIASES.get(folder_name, folder_name)
        declared = _paths().extra_model_extensions.get(kind)
        return folders, declared if declared is not None else set(supported_pt_extensions)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def __setitem__(self, folder_name: str, entry: Any) -> None:
        folders = entry[0] if isinstance(entry, (tuple, list)) and entry else entry
        if isinstance(folders, (str, os.PathLike)):
            folders = [folders]
        kind = _ALIASES.get(folder_name, folder_name)
        paths = _paths()
        # The kind exists from now on, even with no folders yet (packs fill some in later).
        paths.extra_model_dirs.setdefault(kind, [])
        for folder in folders:
            add_model_folder_path(kind, str(folder))
        extensions = entry[1] if isinstance(entry, (tuple, list)) and len(entry) > 1 else None
        if kind not in MODEL_FOLDERS and isinstance(extensions, (set, list, tuple, frozenset)):
            # Kept as given when it is a set: packs add to the set they read back.
            paths.extra_model_extensions[kind] = extensions if isinstance(extensions, set) else set(extensions)

    def __repr__(self) -> str:
        return f"folder_names_and_paths({dict(self)!r})"


# ---------------------------------------------------------------------- folders
def get_input_directory() -> str:
    """The input folder."""
    return str(_paths().input)


def get_output_directory() -> str:
    """The output folder."""
    return str(_paths().output)


def get_temp_directory() -> str:
    """The temp folder (previews)."""
    return str(_paths().temp)


def get_user_directory() -> str:
    """The user folder."""
    return str(_paths().user)


def get_directory_by_type(type_name: str) -> str | None:
    """The folder for 'input', 'output' or 'temp'; None for anything else."""
    try:
        return str(_paths().folder(type_name))
    except UnsafePathError:
        return None


# ---------------------------------------------------------------------- model files
def get_folder_paths(folder_name: str) -> list[str]:
    """Every folder searched for a model kind (models/<kind> first, then added ones)."""
    return [str(p) for p in _paths().model_dirs(_folder_name(folder_name))]


def add_model_folder_path(folder_name: str, full_folder_path: str, is_default: bool = False) -> None:
    """Search another folder for a model kind (first when `is_default`)."""
    folders = _paths().extra_model_dirs.setdefault(_ALIASES.get(folder_name, folder_name), [])
    path = Path(full_folder_path).resolve()
    if path in folders:
        folders.remove(path)
    folders.insert(0, path) if is_default else folders.append(path)


def get_filename_list(folder_name: str) -> list[str]:
    """Files of a kind, relative names with '/', sorted (safetensors only, or a pack's own kind's extensions)."""
    return _paths().list_models(_folder_name(folder_name))


def get_full_path(folder_name: str, filename: str) -> str | None:
    """The full path of a model file, or None when it is not found (or would leave its folder)."""
    try:
        return str(_paths().model_path(_folder_name(folder_name), filename))
    except (FileNotFoundError, UnsafePathError):
        return None


def get_full_path_or_raise(folder_name: str, filename: str) -> str:
    """The full path of a model file; FileNotFoundError names the folders searched."""
    return str(_paths().model_path(_folder_name(folder_name), filename))


# ---------------------------------------------------------------------- input/output files
def get_annotated_filepath(name: str, default_dir: str | None = None) -> str:
    """The path of 'name.png', 'name.png [output]' or 'name.png [temp]' (input folder by default).

    An absolute path is accepted when it lies inside that folder, or (unannotated) inside the
    input, output or temp folder; one anywhere else is refused (UnsafePathError)."""
    if not isinstance(name, str) or not name:
        raise UnsafePathError(f"file name must be a non-empty string, got {name!r}")
    for suffix, kind in _ANNOTATIONS.items():
        if name.endswith(suffix):
            return str(confine(_paths().folder(kind), name[: -len(suffix)], absolute_inside=True))
    roots = [default_dir if default_dir is not None else _paths().input]
    if not name.startswith("/"):
        return str(confine(roots[0], name))
    roots += [_paths().folder(kind) for kind in ("input", "output", "temp")]
    for root in roots:
        try:
            return str(confine(root, name, absolute_inside=True))
        except UnsafePathError:
            continue
    raise UnsafePathError(f"file name {name!r} is absolute and lies outside every folder a plugin may read "
                          f"({', '.join(str(Path(root).resolve()) for root in dict.fromkeys(map(str, roots)))})")


def annotated_filepath(name: str) -> tuple[str, str | None]:
    """('name.png', its folder) for 'name.png [output]' / ' [input]' / ' [temp]'; (name, None) unannotated."""
    for suffix, kind in _ANNOTATIONS.items():
        if name.endswith(suffix):
            return name[: -len(suffix)], str(_paths().folder(kind))
    return name, None


def exists_annotated_filepath(name: str) -> bool:
    """Whether an annotated name is an existing file (False for names leaving their folder)."""
    try:
        return os.path.exists(get_annotated_filepath(name))
    except UnsafePathError:
        return False


def get_save_image_path(filename_prefix: str, output_dir: str, image_width: int = 0,
                        image_height: int = 0) -> tuple[str, str, int, str, str]:
    """(folder, file stem, next counter, subfolder, expanded prefix), as ComfyUI's save nodes expect.

    The caller writes `f"{stem}_{counter:05}_.png"` into the folder. The prefix's subfolder is confined
    to `output_dir`; %width%, %height% and the date tokens are expanded."""
    from nodes.files import expand_prefix

    filename_prefix = expand_prefix(filename_prefix, width=image_width, height=image_height)
    prefix_path = PurePosixPath(filename_prefix)
    subfolder = "" if str(prefix_path.parent) == "." else str(prefix_path.parent)
    stem = prefix_path.name
    folder = confine(output_dir, subfolder) if subfolder else Path(output_dir).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    highest = 0
    for existing in os.listdir(folder):
        if not existing.startswith(stem + "_"):
            continue
        digits = existing[len(stem) + 1:].split("_", 1)
        if len(digits) == 2 and digits[0].isdigit():
            highest = max(highest, int(digits[0]))
    return str(folder), stem, highest + 1, subfolder, filename_prefix


def filter_files_extensions(files: Iterable[str], extensions: Iterable[str]) -> list[str]:
    """The files whose extension is among `extensions` (all files when none are given), sorted."""
    wanted = {e.lower() for e in extensions}
    return sorted(f for f in files if not wanted or os.path.splitext(f)[1].lower() in wanted)


def filter_files_content_types(files: Iterable[str], content_types: Iterable[str]) -> list[str]:
    """The files whose MIME major type ('image', 'video', 'audio', 'text') is among `content_types`."""
    wanted = set(content_types)
    kept = []
    for name in files:
        mime, _ = mimetypes.guess_type(name, strict=False)
        if mime and mime.split("/", 1)[0] in wanted:
            kept.append(name)
    return kept
