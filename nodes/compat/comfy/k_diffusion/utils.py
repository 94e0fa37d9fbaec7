"""ComfyUI's `comfy.k_diffusion.utils` for node packs: `FolderOfImages`, a dataset of a folder's image files.

Video packs use it to read a folder of frames in order. Only that class is provided; the rest of the
module is sampler arithmetic Weft does not expose.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from PIL import Image
from torch.utils import data


class FolderOfImages(data.Dataset):
    """The image files of `root` and every folder below it (sorted by path), each item a one-tuple holding
    the RGB image, passed through `transform` when one is given."""

    IMG_EXTENSIONS = {".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp"}

    def __init__(self, root: str | Path, transform: Callable[[Image.Image], Any] | None = None) -> None:
        super().__init__()
        self.root = Path(root)
        self.transform = transform if transform is not None else (lambda image: image)
        self.paths = sorted(path for path in self.root.rglob("*")
                            if path.is_file() and path.suffix.lower() in self.IMG_EXTENSIONS)

    def __repr__(self) -> str:
        return f"<{len(self)} images under {self.root}>"

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[Any]:
        with Image.open(self.paths[index]) as image:
            return (self.transform(image.convert("RGB")),)
