"""Files written under a hidden temporary name and renamed into place only once they are complete."""
from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def staged_file(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; when the block succeeds, sync it to disk and rename it to `path`.

    A reader that polls the folder (the editor, a file watcher) never sees a half-written file, and a
    failure or an interruption leaves nothing behind.
    """
    staging = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.part")
    try:
        yield staging
        descriptor = os.open(staging, os.O_RDONLY)
        try:
            os.fsync(descriptor)  # the bytes reach the disk before the name points at them
        finally:
            os.close(descriptor)
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)
