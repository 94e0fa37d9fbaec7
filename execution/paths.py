"""Folder layout (input, output, temp, user, models) and the one file-name confinement function."""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from pathlib import Path

MODEL_FOLDERS = (
    "checkpoints", "diffusion_models", "vae", "text_encoders", "loras", "embeddings", "upscale_models",
)
MODEL_EXTENSIONS = (".safetensors", ".sft")


class UnsafePathError(ValueError):
    """A file name from outside that would leave its folder."""


def confine(root: str | os.PathLike, name: str, *, subfolder: str = "") -> Path:
    """Resolve `subfolder/name` inside `root`, refusing anything that would leave it.

    Refuses NUL bytes, absolute paths, drive letters, backslashes and `..` parts, then resolves
    symlinks and checks the result is still under the resolved root. Every file name that comes
    from a request, a prompt or a workflow goes through here.
    """
    root_path = Path(root).resolve()
    parts = []
    for piece in (subfolder or "", name or ""):
        if not isinstance(piece, str):
            raise UnsafePathError(f"file name must be a string, got {type(piece).__name__}")
        if "\x00" in piece:
            raise UnsafePathError(f"file name {piece!r} contains a NUL byte")
        if "\\" in piece:
            raise UnsafePathError(f"file name {piece!r} contains a backslash")
        if piece.startswith("/") or (len(piece) > 1 and piece[1] == ":"):
            raise UnsafePathError(f"file name {piece!r} is absolute")
        for part in piece.split("/"):
            if part in ("..",):
                raise UnsafePathError(f"file name {piece!r} leaves its folder")
            if part and part != ".":
                parts.append(part)
    if not parts and not name:
        raise UnsafePathError("empty file name")
    candidate = root_path.joinpath(*parts)
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
        return [self.models / folder, *self.extra_model_dirs.get(folder, [])]

    def list_models(self, folder: str) -> list[str]:
        """Model files in `models/<folder>` (recursively), as relative names with '/'."""
        names: set[str] = set()
        for root in self.model_dirs(folder):
            if not root.is_dir():
                continue
            for path in root.rglob("*"):
                if path.is_file() and path.suffix.lower() in MODEL_EXTENSIONS:
                    names.add(path.relative_to(root).as_posix())
        return sorted(names)

    def model_path(self, folder: str, name: str) -> Path:
        """The full path of a model file, confined to its folder; FileNotFoundError names the folder."""
        for root in self.model_dirs(folder):
            path = confine(root, name)
            if path.is_file():
                return path
        raise FileNotFoundError(
            f"model file {name!r} not found in {', '.join(str(r) for r in self.model_dirs(folder))}"
        )

    def list_files(self, kind: str, *, suffixes: tuple[str, ...] | None = None) -> list[str]:
        root = self.folder(kind)
        if not root.is_dir():
            return []
        out = []
        for path in sorted(root.rglob("*")):
            if path.is_file() and (suffixes is None or path.suffix.lower() in suffixes):
                out.append(path.relative_to(root).as_posix())
        return out


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary name beside `path`, then rename: a crash never leaves half a file."""
    tmp = path.with_name(f".{path.name}.part")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def next_output_name(folder: Path, prefix: str, extension: str) -> tuple[Path, str, str]:
    """ComfyUI's numbering: `<prefix>_00001_.<ext>` after the highest existing counter.

    Returns (full path, file name, subfolder relative to the output root)."""
    prefix_path = Path(prefix)
    sub = prefix_path.parent.as_posix() if prefix_path.parent != Path(".") else ""
    target_dir = confine(folder, sub) if sub else folder.resolve()
    target_dir.mkdir(parents=True, exist_ok=True)
    stem = prefix_path.name or "weft"
    highest = 0
    # Escaped: a prefix such as "shot[1]" must not act as a pattern (it would restart at 1 and overwrite).
    for existing in target_dir.glob(f"{glob.escape(stem)}_*_.{extension}"):
        middle = existing.name[len(stem) + 1:-(len(extension) + 2)]
        if middle.isdigit():
            highest = max(highest, int(middle))
    name = f"{stem}_{highest + 1:05d}_.{extension}"
    return target_dir / name, name, sub
