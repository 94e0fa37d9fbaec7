"""Loaded model files kept by file identity, so one file is read once however many jobs use it."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable

FileIdentity = tuple[str, int, int]  # (resolved path, size in bytes, modification time in ns)


def file_identity(path: Path) -> FileIdentity:
    """What tells one version of a file from another: its resolved path, size and modification time."""
    stat = path.stat()
    return str(path.resolve()), stat.st_size, stat.st_mtime_ns


class ModelCache:
    """Built objects (models, adapters) keyed by (kind, variant, file identity); safe to share between threads.

    A hit returns exactly what `build()` returned for the same file version. When a file changes in place
    its identity changes, the next `get` builds again, and the entry for the old version is dropped.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple, Any] = {}
        self._lock = threading.Lock()

    identity = staticmethod(file_identity)

    def get(self, kind: str, path: Path, build: Callable[[], Any], *, variant: Any = None) -> Any:
        """The object of `kind` built from `path` (and `variant`); `build()` runs only when there is none yet."""
        resolved, size, mtime = file_identity(path)
        key = (kind, variant, resolved, size, mtime)
        with self._lock:
            if key in self._entries:
                return self._entries[key]
        # Built without the lock: a load can take minutes and should not hold up other files.
        value = build()
        with self._lock:
            outdated = [k for k in self._entries if k[:3] == (kind, variant, resolved) and k != key]
            for old in outdated:
                del self._entries[old]
            return self._entries.setdefault(key, value)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Drop every entry."""
        with self._lock:
            self._entries.clear()
