"""Core image nodes: load, save, preview, create, scale and measure images.

ComfyUI's value types, which every node pack shares:
- IMAGE: float tensor (B, H, W, C) with values in 0..1 (C is 3, or 4 with alpha).
- MASK: float tensor (B, H, W) in 0..1; LoadImage's mask is 1 - alpha (1 = masked out).

File names that come from a prompt go through `execution.paths.confine`; files are written under a
temporary name and renamed, so a crash never leaves half an image where the editor looks.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import random
import string
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps, ImageSequence
from PIL.PngImagePlugin import PngInfo

from execution.context import current
from execution.paths import UnsafePathError, atomic_write_bytes, confine, next_output_name
from nodes.spec import Input, NodeOutput, NodeSpec, Output

logger = logging.getLogger(__name__)

MAX_RESOLUTION = 16384  # ComfyUI's bound on width/height widgets
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
UPSCALE_METHODS = ("nearest-exact", "bilinear", "area", "bicubic", "lanczos")
CROP_METHODS = ("disabled", "center")
# The editor marks a file from another folder as "name.png [output]"; bare names mean input.
_ANNOTATIONS = {" [input]": "input", " [output]": "output", " [temp]": "temp"}
_PREFIX_TOOLTIP = (
    "The prefix for the file to save. It may hold a subfolder ('video/clip') and the tokens %width%, "
    "%height%, %year%, %month%, %day%, %hour%, %minute%, %second%."
)


def input_folder() -> str:
    """The input folder file choices are listed from (named in missing-file errors)."""
    return str(current().paths.input)


# ---------------------------------------------------------------------- file helpers (shared)
def list_input_files(suffixes: tuple[str, ...]) -> list[str]:
    """Files in the input folder with one of `suffixes`, relative with '/', hidden files skipped."""
    names = current().paths.list_files("input", suffixes=suffixes)
    return [n for n in names if not any(part.startswith(".") for part in n.split("/"))]


def annotated_path(name: str, *, default_kind: str = "input") -> Path:
    """The confined path of `name`, honouring the editor's ' [output]' / ' [temp]' suffixes."""
    if not isinstance(name, str) or not name:
        raise UnsafePathError(f"file name must be a non-empty string, got {name!r}")
    kind = default_kind
    for suffix, folder_kind in _ANNOTATIONS.items():
        if name.endswith(suffix):
            name, kind = name[: -len(suffix)], folder_kind
            break
    return confine(current().paths.folder(kind), name)


def annotated_folder(name: str, *, default_kind: str = "input") -> Path:
    """The folder `name` is looked up in (for error messages)."""
    kind = default_kind
    for suffix, folder_kind in _ANNOTATIONS.items():
        if isinstance(name, str) and name.endswith(suffix):
            kind = folder_kind
    return current().paths.folder(kind)


def check_input_file(node: str, kind_label: str, name: Any) -> bool | str:
    """Validation helper: True when `name` is an existing file, else a message naming the folder searched."""
    try:
        path = annotated_path(name)
    except UnsafePathError as exc:
        return f"{node}: invalid {kind_label} file {name!r}: {exc}"
    if not path.is_file():
        return f"{node}: {kind_label} file {name!r} not found (searched folder: {annotated_folder(name)})"
    return True


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes, read in blocks (the fingerprint of loaders)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def expand_prefix(prefix: str, *, width: int = 0, height: int = 0) -> str:
    """Replace ComfyUI's server-side prefix tokens (%width%, %height%, %year% ... %second%)."""
    now = time.localtime()
    tokens = {
        "%width%": str(width), "%height%": str(height), "%year%": str(now.tm_year),
        "%month%": f"{now.tm_mon:02d}", "%day%": f"{now.tm_mday:02d}", "%hour%": f"{now.tm_hour:02d}",
        "%minute%": f"{now.tm_min:02d}", "%second%": f"{now.tm_sec:02d}",
    }
    for token, value in tokens.items():
        prefix = prefix.replace(token, value)
    return prefix


def output_target(kind: str, prefix: str, extension: str, *, width: int = 0, height: int = 0) -> tuple[Path, str, str]:
    """Where the next file for `prefix` goes in the output or temp folder: (path, file name, subfolder).

    The prefix (possibly with a subfolder) is confined to the folder; numbering follows ComfyUI."""
    if not isinstance(prefix, str) or not prefix.strip():
        raise ValueError("filename_prefix must be a non-empty string")
    folder = current().paths.folder(kind)
    folder.mkdir(parents=True, exist_ok=True)
    return next_output_name(folder, expand_prefix(prefix, width=width, height=height), extension)


# The most bytes of JSON metadata (prompt, workflow, ...) embedded in one saved file: 1 MB. Without a
# cap a 50 MB prompt made every 64x64 PNG 50 MB.
MAX_EMBEDDED_METADATA_BYTES = 1_000_000


def file_metadata(prompt: Any, extra_pnginfo: Any, *, limit: int = MAX_EMBEDDED_METADATA_BYTES) -> dict[str, Any]:
    """The workflow/prompt metadata ComfyUI embeds in saved files: {key: JSON-able value}.

    When the entries' JSON together exceeds `limit` bytes, the largest are dropped until the rest fit,
    and a warning names what was dropped (the file itself is still saved)."""
    metadata: dict[str, Any] = {}
    if isinstance(extra_pnginfo, dict):
        metadata.update(extra_pnginfo)
    if prompt is not None:
        metadata["prompt"] = prompt
    sizes = {key: len(json.dumps(value, default=str).encode("utf-8")) for key, value in metadata.items()}
    total = sum(sizes.values())
    dropped = []
    for key in sorted(sizes, key=sizes.__getitem__, reverse=True):
        if total <= limit:
            break
        total -= sizes[key]
        dropped.append(key)
        del metadata[key]
    if dropped:
        logger.warning("saved file metadata: dropped %s (%s bytes of JSON) to stay under the %s-byte cap on "
                       "embedded metadata", ", ".join(map(repr, dropped)), f"{sum(sizes[k] for k in dropped):,}",
                       f"{limit:,}")
    return metadata


def temp_prefix() -> str:
    """A preview file prefix unlikely to collide between jobs (as ComfyUI's `ComfyUI_temp_xxxxx`)."""
    return "ComfyUI_temp_" + "".join(random.choice(string.ascii_lowercase) for _ in range(5))


# ---------------------------------------------------------------------- tensor <-> PIL
def check_image(node: str, image: Any, name: str = "image") -> torch.Tensor:
    """Refuse anything that is not an IMAGE tensor (B, H, W, C)."""
    if not isinstance(image, torch.Tensor) or image.dim() != 4 or image.shape[-1] not in (1, 3, 4):
        shape = tuple(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__
        raise TypeError(f"{node}: input '{name}' must be an IMAGE tensor (B, H, W, C) with C in 1/3/4, got {shape}")
    if image.shape[0] == 0 or image.shape[1] == 0 or image.shape[2] == 0:
        raise ValueError(f"{node}: input '{name}' is empty, shape {tuple(image.shape)}")
    return image


def tensor_to_pil(image: torch.Tensor) -> Image.Image:
    """One IMAGE frame (H, W, C) in 0..1 to an 8-bit PIL image (RGB, RGBA or L)."""
    array = (image.detach().float().clamp(0, 1) * 255.0).round().to(torch.uint8).cpu().numpy()
    if array.shape[-1] == 1:
        return Image.fromarray(array[..., 0])
    return Image.fromarray(array)  # mode from the channel count: RGB or RGBA


def _frame_rgb(frame: Image.Image) -> np.ndarray:
    if frame.mode in ("I;16", "I;16B", "I;16L", "I"):
        # 16-bit greyscale PNGs arrive as integer modes: scale by the 16-bit range, not 8-bit.
        grey = np.asarray(frame, dtype=np.float32) / 65535.0
        return np.repeat(np.clip(grey, 0, 1)[..., None], 3, axis=-1)
    if frame.mode == "F":
        return np.repeat(np.clip(np.asarray(frame, dtype=np.float32), 0, 1)[..., None], 3, axis=-1)
    return np.asarray(frame.convert("RGB"), dtype=np.float32) / 255.0


def _frame_alpha(frame: Image.Image) -> np.ndarray | None:
    if "A" in frame.getbands():
        return np.asarray(frame.getchannel("A"), dtype=np.float32) / 255.0
    if frame.mode == "P" and "transparency" in frame.info:
        return np.asarray(frame.convert("RGBA").getchannel("A"), dtype=np.float32) / 255.0
    return None


MAX_DECODE_PIXELS = 64_000_000  # pixels over all frames of one image file (as the server's upload cap)
MAX_DECODE_FRAMES = 1024  # frames of one animated image file


def check_decode_size(img: Image.Image, name: str) -> None:
    """Refuse an image whose frames together exceed the pixel or frame caps, before decoding any."""
    frames = 1 if img.format == "MPO" else int(getattr(img, "n_frames", 1) or 1)
    width, height = img.size
    if frames > MAX_DECODE_FRAMES:
        raise ValueError(f"image file {name!r} has {frames} frames; at most {MAX_DECODE_FRAMES} are decoded")
    if width * height * frames > MAX_DECODE_PIXELS:
        raise ValueError(f"image file {name!r} holds {frames} frame(s) of {width}x{height} pixels, over the "
                         f"limit of {MAX_DECODE_PIXELS // 1_000_000} MP over all frames")


def load_image_file(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode an image file (every frame of the first frame's size) to (IMAGE, MASK).

    The mask is 1 - alpha; without alpha it is ComfyUI's zero 64x64 mask per frame. The pixels of
    all frames together are checked against the caps before anything is decoded."""
    with Image.open(path) as img:
        check_decode_size(img, path.name)
        frames, alphas = [], []
        size = None
        # Multi-picture JPEGs (MPO) hold a preview picture, not animation frames.
        iterator = [img] if img.format == "MPO" else ImageSequence.Iterator(img)
        for frame in iterator:
            frame = ImageOps.exif_transpose(frame)
            if size is None:
                size = frame.size
            if frame.size != size:
                continue
            frames.append(_frame_rgb(frame))
            alphas.append(_frame_alpha(frame))
    if not frames:
        raise ValueError(f"image file {path.name!r} holds no frames")
    images = torch.from_numpy(np.stack(frames))
    if all(a is None for a in alphas):
        masks = torch.zeros((len(frames), 64, 64), dtype=torch.float32)
    else:
        height, width = frames[0].shape[:2]
        masks = torch.stack([
            torch.zeros((height, width)) if a is None else 1.0 - torch.from_numpy(a) for a in alphas
        ])
    return images, masks


# ---------------------------------------------------------------------- scaling (shared)
def _center_crop(samples: torch.Tensor, width: int, height: int) -> torch.Tensor:
    old_h, old_w = samples.shape[-2], samples.shape[-1]
    old_aspect, new_aspect = old_w / old_h, width / height
    if old_aspect > new_aspect:  # too wide: trim columns
        cut = round((old_w - old_w * (new_aspect / old_aspect)) / 2)
        return samples[..., :, cut:old_w - cut]
    if old_aspect < new_aspect:  # too tall: trim rows
        cut = round((old_h - old_h * (old_aspect / new_aspect)) / 2)
        return samples[..., cut:old_h - cut, :]
    return samples


def _lanczos(samples: torch.Tensor, width: int, height: int) -> torch.Tensor:
    # PIL resizes float ('F') planes with Lanczos, so no 8-bit rounding happens on the way.
    planes = samples.detach().float().cpu().numpy()
    out = np.empty(planes.shape[:2] + (height, width), dtype=np.float32)
    for b in range(planes.shape[0]):
        for c in range(planes.shape[1]):
            plane = Image.fromarray(planes[b, c])  # float32 -> mode F
            out[b, c] = np.asarray(plane.resize((width, height), Image.Resampling.LANCZOS))
    return torch.from_numpy(out).to(samples.device, samples.dtype)


def scale_images(image: torch.Tensor, width: int, height: int, method: str, crop: str = "disabled") -> torch.Tensor:
    """Resize an IMAGE (B, H, W, C) to width x height, optionally center-cropping to the aspect first."""
    if method not in UPSCALE_METHODS:
        raise ValueError(f"upscale method {method!r} unknown; expected one of {UPSCALE_METHODS}")
    if width < 1 or height < 1:
        raise ValueError(f"target size {width}x{height} must be at least 1x1")
    samples = image.movedim(-1, 1)  # (B, C, H, W)
    if crop == "center":
        samples = _center_crop(samples, width, height)
    if method == "lanczos":
        out = _lanczos(samples, width, height)
    else:
        kwargs = {"align_corners": False} if method in ("bilinear", "bicubic") else {}
        out = F.interpolate(samples.float(), size=(height, width), mode=method, **kwargs).to(image.dtype)
    if method in ("bicubic", "lanczos"):
        out = out.clamp(0, 1)  # these kernels overshoot; IMAGE values stay in 0..1
    return out.movedim(1, -1).contiguous()


# ---------------------------------------------------------------------- node functions
def _load_image(image: str) -> tuple[torch.Tensor, torch.Tensor]:
    path = annotated_path(image)
    if not path.is_file():
        raise FileNotFoundError(f"LoadImage: image file {image!r} not found (searched folder: {annotated_folder(image)})")
    try:
        return load_image_file(path)
    except (OSError, ValueError, Image.DecompressionBombError) as exc:  # not an image, truncated, or too large
        raise ValueError(f"LoadImage: cannot read image file {image!r}: {exc}") from exc


def _load_image_fingerprint(image: str, **_other: Any) -> str:
    return file_sha256(annotated_path(image))


def _load_image_validate(image: Any = None, **_other: Any) -> bool | str:
    return check_input_file("LoadImage", "image", image)


def _save_png_batch(node: str, images: torch.Tensor, prefix: str, kind: str, compress_level: int,
                    metadata: dict[str, Any]) -> list[dict[str, str]]:
    images = check_image(node, images, "images")
    results = []
    for batch_number, frame in enumerate(images):
        pil = tensor_to_pil(frame)
        info = None
        if metadata:
            info = PngInfo()
            for key, value in metadata.items():
                info.add_text(str(key), json.dumps(value))
        name_prefix = prefix.replace("%batch_num%", str(batch_number))
        path, filename, subfolder = output_target(kind, name_prefix, "png", width=pil.width, height=pil.height)
        buffer = io.BytesIO()
        pil.save(buffer, format="PNG", pnginfo=info, compress_level=compress_level)
        atomic_write_bytes(path, buffer.getvalue())
        results.append({"filename": filename, "subfolder": subfolder, "type": kind})
    return results


def _save_image(images: torch.Tensor, filename_prefix: str = "ComfyUI", prompt: Any = None,
                extra_pnginfo: Any = None) -> NodeOutput:
    results = _save_png_batch("SaveImage", images, filename_prefix, "output", 4, file_metadata(prompt, extra_pnginfo))
    return NodeOutput.of(images, ui={"images": results})


def _preview_image(images: torch.Tensor, prompt: Any = None, extra_pnginfo: Any = None) -> NodeOutput:
    # Previews are disposable: fast compression, temp folder.
    results = _save_png_batch("PreviewImage", images, temp_prefix(), "temp", 1, file_metadata(prompt, extra_pnginfo))
    return NodeOutput.of(images, ui={"images": results})


def _empty_image(width: int, height: int, batch_size: int = 1, color: int = 0) -> tuple[torch.Tensor]:
    rgb = torch.tensor([(color >> 16) & 0xFF, (color >> 8) & 0xFF, color & 0xFF], dtype=torch.float32) / 255.0
    return (rgb.expand(batch_size, height, width, 3).contiguous(),)


def _image_scale(image: torch.Tensor, upscale_method: str, width: int, height: int, crop: str) -> tuple[torch.Tensor]:
    image = check_image("ImageScale", image)
    if width == 0 and height == 0:
        return (image,)
    src_h, src_w = image.shape[1], image.shape[2]
    if width == 0:  # keep the aspect ratio from the given height
        width = max(1, round(src_w * height / src_h))
    elif height == 0:
        height = max(1, round(src_h * width / src_w))
    return (scale_images(image, width, height, upscale_method, crop),)


def _image_scale_to_total_pixels(image: torch.Tensor, upscale_method: str, megapixels: float,
                                 resolution_steps: int = 1) -> tuple[torch.Tensor]:
    image = check_image("ImageScaleToTotalPixels", image)
    src_h, src_w = image.shape[1], image.shape[2]
    scale_by = math.sqrt(megapixels * 1024 * 1024 / (src_w * src_h))
    width = max(resolution_steps, round(src_w * scale_by / resolution_steps) * resolution_steps)
    height = max(resolution_steps, round(src_h * scale_by / resolution_steps) * resolution_steps)
    return (scale_images(image, int(width), int(height), upscale_method),)


def _get_image_size(image: torch.Tensor, unique_id: Any = None) -> tuple[int, int, int]:
    image = check_image("GetImageSize", image)
    batch_size, height, width = int(image.shape[0]), int(image.shape[1]), int(image.shape[2])
    current().progress(1, 1, text=f"width: {width}, height: {height}\n batch size: {batch_size}")
    return width, height, batch_size


_IMAGE_CHOICE = Input.combo("image", lambda: list_input_files(IMAGE_EXTENSIONS), image_upload=True, folder=input_folder)

NODES = [
    NodeSpec(
        node_id="LoadImage", display_name="Load Image", category="image", python_module="nodes",
        description="Load an image from the input folder; outputs the image and a mask (1 - alpha).",
        execute=_load_image, inputs=[_IMAGE_CHOICE],
        outputs=[Output("IMAGE"), Output("MASK")],
        fingerprint=_load_image_fingerprint, validate_inputs=_load_image_validate,
        validate_takes=frozenset({"image"}),
        search_aliases=("load image", "open image", "import image", "image input", "upload image"),
    ),
    NodeSpec(
        node_id="SaveImage", display_name="Save Image", category="image", python_module="nodes",
        description="Saves the input images to your ComfyUI output directory.",
        execute=_save_image, output_node=True,
        inputs=[
            Input.link("images", "IMAGE", tooltip="The images to save."),
            Input.string("filename_prefix", "ComfyUI", tooltip=_PREFIX_TOOLTIP),
            Input.hidden("prompt", "PROMPT"),
            Input.hidden("extra_pnginfo", "EXTRA_PNGINFO"),
        ],
        outputs=[Output("IMAGE", "images")],
        search_aliases=("save", "save image", "export image", "output image", "write image"),
    ),
    NodeSpec(
        node_id="PreviewImage", display_name="Preview Image", category="image", python_module="nodes",
        description="Preview the images without saving them to the ComfyUI output directory.",
        execute=_preview_image, output_node=True,
        inputs=[
            Input.link("images", "IMAGE"),
            Input.hidden("prompt", "PROMPT"),
            Input.hidden("extra_pnginfo", "EXTRA_PNGINFO"),
        ],
        outputs=[Output("IMAGE", "images")],
        search_aliases=("preview", "preview image", "show image", "view image"),
    ),
    NodeSpec(
        node_id="EmptyImage", category="image", python_module="nodes",
        description="An image batch filled with one color (0xRRGGBB).",
        execute=_empty_image,
        inputs=[
            Input.int("width", 512, min=1, max=MAX_RESOLUTION, step=1),
            Input.int("height", 512, min=1, max=MAX_RESOLUTION, step=1),
            Input.int("batch_size", 1, min=1, max=4096),
            Input.int("color", 0, min=0, max=0xFFFFFF, step=1, display="color"),
        ],
        outputs=[Output("IMAGE")],
    ),
    NodeSpec(
        node_id="ImageScale", display_name="Upscale Image", category="image/upscaling", python_module="nodes",
        description="Resize images; a width or height of 0 keeps the aspect ratio, both 0 leave them unchanged.",
        execute=_image_scale,
        inputs=[
            Input.link("image", "IMAGE"),
            Input.combo("upscale_method", list(UPSCALE_METHODS)),
            Input.int("width", 512, min=0, max=MAX_RESOLUTION, step=1),
            Input.int("height", 512, min=0, max=MAX_RESOLUTION, step=1),
            Input.combo("crop", list(CROP_METHODS)),
        ],
        outputs=[Output("IMAGE")],
        search_aliases=("resize", "resize image", "scale image", "image resize"),
    ),
    NodeSpec(
        node_id="ImageScaleToTotalPixels", display_name="Scale Image to Total Pixels", category="image/upscaling",
        python_module="comfy_extras.nodes_post_processing",
        description="Resize images to about `megapixels` (x 1024 x 1024) pixels, keeping the aspect ratio.",
        execute=_image_scale_to_total_pixels,
        inputs=[
            Input.link("image", "IMAGE"),
            Input.combo("upscale_method", list(UPSCALE_METHODS)),
            Input.float("megapixels", 1.0, min=0.01, max=16.0, step=0.01),
            Input.int("resolution_steps", 1, min=1, max=256),
        ],
        outputs=[Output("IMAGE")],
    ),
    NodeSpec(
        node_id="GetImageSize", display_name="Get Image Size", category="image",
        python_module="comfy_extras.nodes_images",
        description="Returns the width, height, and batch size of the image.",
        execute=_get_image_size,
        inputs=[Input.link("image", "IMAGE"), Input.hidden("unique_id", "UNIQUE_ID")],
        outputs=[Output("INT", "width"), Output("INT", "height"), Output("INT", "batch_size")],
        search_aliases=("dimensions", "resolution", "image info"),
    ),
]
