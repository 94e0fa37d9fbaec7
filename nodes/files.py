"""Where node files live: input choices, the editor's folder annotations, output names, saved metadata.

Every name that arrives in a prompt is resolved through `execution.paths.confine`, so it cannot leave
its folder. These helpers read the running job's folders from its RunContext.
"""
from __future__ import annotations

import hashlib
import json
import logging
import random
import string
import time
from pathlib import Path
from typing import Any

from execution.context import current
from execution.paths import PREVIEW_FILE_PREFIX, UnsafePathError, confine, next_output_name

# The editor may name a file in another folder by a suffix, "clip.png [output]"; no suffix means input.
_FOLDER_SUFFIXES = {" [input]": "input", " [output]": "output", " [temp]": "temp"}
_HASH_BLOCK_BYTES = 1 << 20
# At most this much JSON (prompt, workflow, ...) is stored in one saved file, so a huge prompt cannot make
# every small picture huge.
MAX_EMBEDDED_METADATA_BYTES = 1_000_000

logger = logging.getLogger(__name__)


def folder_of(kind: str) -> Path:
    """The running job's folder of `kind` (input, output or temp)."""
    return current().paths.folder(kind)


def list_folder_files(kind: str, suffixes: tuple[str, ...]) -> list[str]:
    """Names of the files in the `kind` folder ending in one of `suffixes`, '/'-separated, hidden ones left out."""
    names = current().paths.list_files(kind, suffixes=suffixes)
    return [name for name in names if not any(part.startswith(".") for part in name.split("/"))]


def _split_suffix(name: str, default_kind: str) -> tuple[str, str]:
    """(bare name, folder kind) of a name that may end in one of the editor's folder suffixes."""
    for suffix, kind in _FOLDER_SUFFIXES.items():
        if name.endswith(suffix):
            return name[: -len(suffix)], kind
    return name, default_kind


def annotated_path(name: str, *, default_kind: str = "input") -> Path:
    """The file `name` stands for, confined to its folder (input, or the one a ' [output]'-style suffix names)."""
    if not isinstance(name, str) or not name:
        raise UnsafePathError(f"a file name must be a non-empty string, not {name!r}")
    bare, kind = _split_suffix(name, default_kind)
    return confine(current().paths.folder(kind), bare)


def annotated_folder(name: str, *, default_kind: str = "input") -> Path:
    """The folder `name` is looked for in, for messages about a missing file."""
    kind = _split_suffix(name, default_kind)[1] if isinstance(name, str) else default_kind
    return current().paths.folder(kind)


def check_input_file(node: str, kind_label: str, name: Any, *, default_kind: str = "input") -> bool | str:
    """True when `name` is a file that exists; otherwise a message that names the node and the folder looked in."""
    try:
        path = annotated_path(name, default_kind=default_kind)
    except UnsafePathError as exc:
        return f"{node}: invalid {kind_label} file {name!r}: {exc}"
    if not path.is_file():
        folder = annotated_folder(name, default_kind=default_kind)
        return (f"{node}: {kind_label} file {name!r} not found (searched folder: {folder}); put the file there, "
                f"upload it in the editor (or POST /upload/image), or choose another file")
    from media.probe import header_problem

    problem = header_problem(path, kind_label)
    if problem is not None:
        return f"{node}: {kind_label} file {name!r} {problem}"
    return True


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's content in hex, read a megabyte at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(_HASH_BLOCK_BYTES), b""):
            digest.update(block)
    return digest.hexdigest()


def expand_prefix(prefix: str, *, width: int = 0, height: int = 0) -> str:
    """`prefix` with the %width%, %height% and date/time tokens (%year% ... %second%) filled in."""
    now = time.localtime()
    values = {
        "%width%": str(width), "%height%": str(height), "%year%": str(now.tm_year),
        "%month%": f"{now.tm_mon:02d}", "%day%": f"{now.tm_mday:02d}", "%hour%": f"{now.tm_hour:02d}",
        "%minute%": f"{now.tm_min:02d}", "%second%": f"{now.tm_sec:02d}",
    }
    for token, value in values.items():
        prefix = prefix.replace(token, value)
    return prefix


def output_target(kind: str, prefix: str, extension: str, *, width: int = 0, height: int = 0) -> tuple[Path, str, str]:
    """(path, file name, subfolder) of the next unused numbered file for `prefix` in the output or temp folder.

    The prefix may carry a subfolder; it stays confined to the folder."""
    if not isinstance(prefix, str) or not prefix.strip():
        raise ValueError("filename_prefix must be a non-empty string")
    folder = current().paths.folder(kind)
    folder.mkdir(parents=True, exist_ok=True)
    return next_output_name(folder, expand_prefix(prefix, width=width, height=height), extension)


def file_metadata(prompt: Any, extra_pnginfo: Any, *, limit: int = MAX_EMBEDDED_METADATA_BYTES) -> dict[str, Any]:
    """What a saved file records about the run that made it: the editor's extra info and the prompt.

    Entries are left out, biggest first, until their JSON fits in `limit` bytes; a warning names them.
    The file is saved either way."""
    metadata: dict[str, Any] = {}
    if isinstance(extra_pnginfo, dict):
        metadata.update(extra_pnginfo)
    if prompt is not None:
        metadata["prompt"] = prompt
    sizes = {key: len(json.dumps(value, default=str).encode("utf-8")) for key, value in metadata.items()}
    total = sum(sizes.values())
    left_out = []
    for key in sorted(sizes, key=sizes.__getitem__, reverse=True):
        if total <= limit:
            break
        total -= sizes[key]
        left_out.append(key)
        del metadata[key]
    if left_out:
        logger.warning("saved file metadata: left out %s (%s bytes of JSON) to stay under the %s-byte cap on "
                       "embedded metadata", ", ".join(map(repr, left_out)), f"{sum(sizes[k] for k in left_out):,}",
                       f"{limit:,}")
    return metadata


def temp_prefix() -> str:
    """A fresh prefix for preview files, random enough that two jobs do not share it."""
    return PREVIEW_FILE_PREFIX + "".join(random.choice(string.ascii_lowercase) for _ in range(5))
