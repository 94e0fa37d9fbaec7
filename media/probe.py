"""A quick look at a media file's header: can it be opened as the kind of file it is said to be?

Validation calls this for each input file a workflow names, so a corrupt or mislabelled picture, video or
sound is reported before a job starts, not as a decoder's traceback in the middle of it. Only headers are
read (Pillow's `verify`, PyAV's container probe), never the whole file.
"""
from __future__ import annotations

from pathlib import Path


def header_problem(path: Path, kind: str) -> str | None:
    """Why `path` cannot be read as a `kind` file ("image", "video" or "audio"), or None when it can (or
    when `kind` is none of those)."""
    if kind == "image":
        return _image_problem(path)
    if kind in ("video", "audio"):
        return _container_problem(path, kind)
    return None


def _image_problem(path: Path) -> str | None:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            image.verify()
    except UnidentifiedImageError:
        return "is not a picture Pillow can read (unknown or corrupt format)"
    except (OSError, SyntaxError, ValueError) as exc:  # Pillow reports a broken header as any of these
        return f"is a corrupt picture ({exc})"
    return None


def _container_problem(path: Path, kind: str) -> str | None:
    import av

    try:
        with av.open(str(path)) as container:
            streams = [s for s in container.streams if s.type == kind]
            if kind == "video" and not streams:
                return "holds no video stream"
            if kind == "audio" and not streams:
                return "holds no audio stream"
    except (av.FFmpegError, OSError, ValueError) as exc:
        return f"is not a {kind} file PyAV can open ({exc})"
    return None
