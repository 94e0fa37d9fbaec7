"""Folder layout (input, output, temp, user, models) and the one file-name confinement function."""
from __future__ import annotations

import glob
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODEL_FOLDERS = (
    "checkpoints", "diffusion_models", "vae", "text_encoders", "loras", "embeddings", "upscale_models",
    "model_patches", "vae_approx",
)
MODEL_EXTENSIONS = (".safetensors", ".sft")
GGUF_EXTENSIONS = (".gguf",)
# Older folder names ComfyUI still searches for the same kind: models/unet holds diffusion models and
# models/clip text encoders (files there are listed and found with those of the current folder).
LEGACY_MODEL_FOLDERS = {"diffusion_models": ("unet",), "text_encoders": ("clip",)}
# Pickle formats: never listed, whatever extensions a pack declares for a folder kind of its own.
PICKLE_EXTENSIONS = (".ckpt", ".pt", ".pth", ".bin", ".pkl", ".pickle")


class UnsafePathError(ValueError):
    """A file name from outside that would leave its folder."""


PREVIEW_FILE_PREFIX = "ComfyUI_temp_"  # provenance: interface (PreviewImage's temporary files, as ComfyUI names them)


def unusable_character(name: str) -> str | None:
    """The first character of `name` that has no place in a file name, or None.

    Control characters (C0, DEL, C1), line and paragraph separators and lone surrogates cannot be
    carried in an HTTP header (the file's Content-Disposition) nor written by every file system."""
    for char in name:
        code = ord(char)
        if code < 0x20 or 0x7F <= code < 0xA0 or code in (0x2028, 0x2029) or 0xD800 <= code < 0xE000:
            return char
    return None


def check_name_characters(name: str, what: str = "file name") -> None:
    """Refuse a name holding a character `unusable_character` finds (UnsafePathError naming it)."""
    bad = unusable_character(name)
    if bad is not None:
        raise UnsafePathError(f"{what} {name[:100]!r} contains the character {bad!r}, "
                              "which a file name cannot hold")


def confine(root: str | os.PathLike, name: str, *, subfolder: str = "", absolute_inside: bool = False) -> Path:
    """Resolve `subfolder/name` inside `root`, refusing anything that would leave it.

    Refuses NUL bytes, absolute paths, drive letters, backslashes and `..` parts, then resolves
    symlinks and checks the result is still under the resolved root. Every file name that comes
    from a request, a prompt or a workflow goes through here. With `absolute_inside`, an absolute
    POSIX `name` (and no subfolder) is taken as it is, and passes only when it lies under the root.
    """
    root_path = Path(root).resolve()
    start = root_path
    parts = []
    for piece in (subfolder or "", name or ""):
        if not isinstance(piece, str):
            raise UnsafePathError(f"file name must be a string, got {type(piece).__name__}")
        if "\x00" in piece:
            raise UnsafePathError(f"file name {piece!r} contains a NUL byte")
        check_name_characters(piece)
        if "\\" in piece:
            raise UnsafePathError(f"file name {piece!r} contains a backslash")
        if piece.startswith("/") or (len(piece) > 1 and piece[1] == ":"):
            if not (absolute_inside and not subfolder and piece.startswith("/")):
                raise UnsafePathError(f"file name {piece!r} is absolute")
            start = Path("/")
        for part in piece.split("/"):
            if part in ("..",):
                raise UnsafePathError(f"file name {piece!r} leaves its folder")
            if part and part != ".":
                parts.append(part)
    if not parts and not name:
        raise UnsafePathError("empty file name")
    candidate = start.joinpath(*parts)
    resolved = candidate.resolve()
    if resolved != root_path and root_path not in resolved.parents:
        raise UnsafePathError(f"file name {name!r} resolves outside its folder")
    return resolved


@dataclass
class Paths:
    """Where Weft reads and writes. `base` holds models/, input/, output/, temp/, user/, custom_nodes/."""

    base: Path
    input: Path | None = None
    output: Path | None = None
    temp: Path | None = None
    user: Path | None = None
    models: Path | None = None
    extra_model_dirs: dict[str, list[Path]] = field(default_factory=dict)
    # File extensions a pack declared for a folder kind of its own (`folder_names_and_paths[kind] =
    # (folders, {".json"})`); the pack's own set object, which it may add to later. Weft's model kinds
    # always list safetensors files only.
    extra_model_extensions: dict[str, set[str]] = field(default_factory=dict)

    def __post_init__(self):
        self.base = Path(self.base).resolve()
        self.input = Path(self.input or self.base / "input").resolve()
        self.output = Path(self.output or self.base / "output").resolve()
        self.temp = Path(self.temp or self.base / "temp").resolve()
        self.user = Path(self.user or self.base / "user").resolve()
        self.models = Path(self.models or self.base / "models").resolve()

    def ensure(self) -> "Paths":
        for folder in (self.input, self.output, self.temp, self.user):
            folder.mkdir(parents=True, exist_ok=True)
        for name in MODEL_FOLDERS:
            (self.models / name).mkdir(parents=True, exist_ok=True)
        return self

    def folder(self, kind: str) -> Path:
        """The folder for a file `type` as the editor names it: input, output or temp."""
        if kind == "input":
            return self.input
        if kind == "output":
            return self.output
        if kind == "temp":
            return self.temp
        raise UnsafePathError(f"unknown folder type {kind!r}; expected input, output or temp")

    def model_dirs(self, folder: str) -> list[Path]:
        legacy = [self.models / name for name in LEGACY_MODEL_FOLDERS.get(folder, ())]
        return [self.models / folder, *legacy, *self.extra_model_dirs.get(folder, [])]

    def model_suffixes(self, folder: str) -> tuple[str, ...]:
        """The extensions listed for a folder kind: safetensors for Weft's kinds and for a pack's kind
        that declared none, else the pack's own (pickle formats never)."""
        declared = self.extra_model_extensions.get(folder)
        if folder in MODEL_FOLDERS or not declared:
            return MODEL_EXTENSIONS
        return tuple(s.lower() for s in declared if s.lower() not in PICKLE_EXTENSIONS)

    def list_models(self, folder: str, suffixes: tuple[str, ...] | None = None) -> list[str]:
        """Model files in `models/<folder>` (recursively) whose suffix is one of `suffixes` (default: the
        folder kind's, `model_suffixes`), as relative names with '/'."""
        names: set[str] = set()
        suffixes = self.model_suffixes(folder) if suffixes is None else suffixes
        for root in self.model_dirs(folder):
            if not root.is_dir():
                continue
            for path in root.rglob("*"):
                if path.is_file() and path.suffix.lower() in suffixes:
                    names.add(path.relative_to(root).as_posix())
        return sorted(names)

    def model_path(self, folder: str, name: str) -> Path:
        """The full path of a model file, confined to its folder; FileNotFoundError names the folder."""
        for root in self.model_dirs(folder):
            path = confine(root, name)
            if path.is_file():
                return path
        raise FileNotFoundError(
            f"model file {name!r} not found in {', '.join(self.shown(r) for r in self.model_dirs(folder))}"
        )

    def shown(self, path: str | os.PathLike) -> str:
        """`path` as messages show it: relative to the base folder when inside it (no server paths leak)."""
        return shown_path(path, self.base)

    def list_files(self, kind: str, *, suffixes: tuple[str, ...] | None = None) -> list[str]:
        root = self.folder(kind)
        if not root.is_dir():
            return []
        out = []
        for path in sorted(root.rglob("*")):
            if path.is_file() and (suffixes is None or path.suffix.lower() in suffixes):
                out.append(path.relative_to(root).as_posix())
        return out


def shown_path(path: str | os.PathLike, base: str | os.PathLike) -> str:
    """`path` relative to `base` when it lies inside, else its last two components."""
    resolved = Path(path)
    try:
        return resolved.relative_to(Path(base)).as_posix() or "."
    except ValueError:
        return Path(*resolved.parts[-2:]).as_posix() if len(resolved.parts) > 1 else resolved.as_posix()


def scrub_base(value: Any, base: str | os.PathLike) -> Any:
    """`value` (strings inside dicts and lists too) with the base folder's absolute path removed."""
    prefix = str(base).rstrip(os.sep) + os.sep
    if isinstance(value, str):
        return value.replace(prefix, "") if prefix in value else value
    if isinstance(value, dict):
        return {k: scrub_base(v, base) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(scrub_base(v, base) for v in value)
    return value


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary name beside `path`, then rename: a crash never leaves half a file."""
    tmp = path.with_name(f".{path.name}.part")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


STAGING_PREFIX = ".weft-staged-"  # an unfinished attempt's output: `.weft-staged-<token>-<final name>`
TOKEN_LENGTH = 16


def staging_token(prompt_id: str) -> str:
    """The fixed-length token a job's staged file names carry (any prompt id fits in a file name this way)."""
    return hashlib.sha1(str(prompt_id).encode("utf-8", "surrogatepass")).hexdigest()[:TOKEN_LENGTH]


def _staged_parts(name: str) -> tuple[str, str] | None:
    """(token, final name) of a staging file name, or None."""
    if not name.startswith(STAGING_PREFIX):
        return None
    rest = name[len(STAGING_PREFIX):]
    if len(rest) <= TOKEN_LENGTH + 1 or rest[TOKEN_LENGTH] != "-":
        return None
    return rest[:TOKEN_LENGTH], rest[TOKEN_LENGTH + 1:]


class OutputStaging:
    """The files one job attempt writes, kept under staging names until its record is written.

    The job's record is written first, then `commit_staged` gives the files their final names. A
    process killed in between leaves staging names only: `settle_staged` finishes the rename for a job
    that has its record and removes the files of an attempt that has none (it will run again), so a
    retried job's outputs exist once, under their final names."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.files: list[tuple[str, str]] = []  # (staging path, final path)

    def stage(self, final: Path) -> Path:
        """The path to write instead of `final` during the attempt."""
        staged = final.with_name(f"{STAGING_PREFIX}{self.token}-{final.name}")
        self.files.append((str(staged), str(final)))
        return staged


_staging: list[OutputStaging] = []  # the attempt running in this process (jobs run one at a time)


def begin_staging(token: str) -> OutputStaging:
    """Stage the outputs `next_output_name` hands out from now until `end_staging`."""
    staging = OutputStaging(token)
    _staging[:] = [staging]
    return staging


def end_staging() -> list[tuple[str, str]]:
    """Stop staging; the (staging path, final path) pairs the attempt wrote."""
    if not _staging:
        return []
    staging = _staging.pop()
    return [(staged, final) for staged, final in staging.files if os.path.exists(staged)]


def commit_staged(files: list[tuple[str, str]] | list[list[str]]) -> None:
    """Give staged files their final names (after the job's record is written)."""
    for staged, final in files:
        if os.path.exists(staged):
            os.replace(staged, final)


def settle_staged(folders: list[Path] | tuple[Path, ...], committed_tokens: set[str], *,
                  keep: frozenset[str] | set[str] = frozenset()) -> dict[str, int]:
    """After a process died: finish the rename of staged files whose job has its record (token in
    `committed_tokens`), remove every other staged file but those of the attempts still running
    (token in `keep`: other workers' jobs). Returns {"committed": n, "removed": m}."""
    report = {"committed": 0, "removed": 0}
    for folder in folders:
        if not Path(folder).is_dir():
            continue
        # A write cut short leaves its temporary `.<staged name>...part` beside the staged name: never whole.
        for path in Path(folder).rglob("." + STAGING_PREFIX + "*.part"):
            parts = _staged_parts(path.name[1:])
            if parts is not None and parts[0] in keep:
                continue
            if path.is_file():
                path.unlink(missing_ok=True)
                report["removed"] += 1
        for path in Path(folder).rglob(STAGING_PREFIX + "*"):
            parts = _staged_parts(path.name)
            if not path.is_file() or (parts is not None and parts[0] in keep):
                continue
            if parts is not None and parts[0] in committed_tokens:
                os.replace(path, path.with_name(parts[1]))
                report["committed"] += 1
            else:
                path.unlink(missing_ok=True)
                report["removed"] += 1
    return report


def find_staged(final: Path) -> Path | None:
    """The staged file that will become `final` (a running job's output), or None."""
    pattern = glob.escape(STAGING_PREFIX) + "?" * TOKEN_LENGTH + "-" + glob.escape(final.name)
    found = sorted(final.parent.glob(pattern), key=lambda p: p.stat().st_mtime) if final.parent.is_dir() else []
    return found[-1] if found else None


def next_output_name(folder: Path, prefix: str, extension: str) -> tuple[Path, str, str]:
    """ComfyUI's numbering: `<prefix>_00001_.<ext>` after the highest existing counter.

    Returns (path to write, file name, subfolder relative to the output root). While a job attempt
    stages its outputs, the path to write is the staging name of that file name."""
    check_name_characters(prefix, "file name prefix")
    prefix_path = Path(prefix)
    sub = prefix_path.parent.as_posix() if prefix_path.parent != Path(".") else ""
    target_dir = confine(folder, sub) if sub else folder.resolve()
    target_dir.mkdir(parents=True, exist_ok=True)
    stem = prefix_path.name or "weft"
    highest = 0
    # Escaped: a prefix such as "shot[1]" must not act as a pattern (it would restart at 1 and overwrite).
    pattern = f"{glob.escape(stem)}_*_.{extension}"
    staged_pattern = glob.escape(STAGING_PREFIX) + "?" * TOKEN_LENGTH + "-" + pattern
    # Staged names first: another attempt may rename its staged file to the final name at any moment, and
    # listing the final names first could miss that file under both names and hand out its counter again.
    for existing in [*target_dir.glob(staged_pattern), *target_dir.glob(pattern)]:
        parts = _staged_parts(existing.name)
        name = parts[1] if parts else existing.name
        middle = name[len(stem) + 1:-(len(extension) + 2)]
        if middle.isdigit():
            highest = max(highest, int(middle))
    name = f"{stem}_{highest + 1:05d}_.{extension}"
    path = target_dir / name
    if _staging:
        path = _staging[0].stage(path)
    return path, name, sub
