"""IMAGE values: checking, decoding files with Pillow, PNG encoding, cropping and resizing."""
from __future__ import annotations

import io
import json
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps, ImageSequence
from PIL.PngImagePlugin import PngInfo

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
UPSCALE_METHODS = ("nearest-exact", "bilinear", "area", "bicubic", "lanczos")
CROP_METHODS = ("disabled", "center")
MAX_DECODE_PIXELS = 64_000_000  # pixels of all frames of one file together (the server's upload cap too)
MAX_DECODE_FRAMES = 1024  # frames of one animated file
EMPTY_MASK_SIZE = 64  # side of the all-zero mask an image without alpha gets (what ComfyUI's loader returns)
_SIXTEEN_BIT_MODES = ("I;16", "I;16B", "I;16L", "I")


def check_image(node: str, image: Any, name: str = "image") -> torch.Tensor:
    """`image` when it is a non-empty IMAGE tensor (B, H, W, C) with C of 1, 3 or 4; else an error."""
    if not isinstance(image, torch.Tensor) or image.dim() != 4 or image.shape[-1] not in (1, 3, 4):
        got = tuple(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__
        raise TypeError(f"{node}: input '{name}' takes an IMAGE, a (batch, height, width, channels) tensor with "
                        f"1, 3 or 4 channels; got {got}")
    if 0 in image.shape[:3]:
        raise ValueError(f"{node}: input '{name}' holds no pixels (shape {tuple(image.shape)})")
    return image


def tensor_to_pil(image: torch.Tensor) -> Image.Image:
    """One frame (H, W, C) in 0..1 as an 8-bit Pillow image: L, RGB or RGBA by its channel count.

    Values are scaled by 255 and truncated, not rounded, as ComfyUI writes them (0.25 is 63), so a
    saved image has the same bytes in both."""
    pixels = (image.detach().float().clamp(0, 1) * 255.0).to(torch.uint8).cpu().numpy()
    return Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels)


def encode_png(frame: torch.Tensor, *, compress_level: int, metadata: dict[str, Any] | None = None) -> bytes:
    """One frame (H, W, C) in 0..1 as PNG bytes, each `metadata` value stored as a JSON text chunk."""
    text = None
    if metadata:
        text = PngInfo()
        for key, value in metadata.items():
            text.add_text(str(key), json.dumps(value))
    out = io.BytesIO()
    tensor_to_pil(frame).save(out, format="PNG", pnginfo=text, compress_level=compress_level)
    return out.getvalue()


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def encode_png16(frame: torch.Tensor, *, compress_level: int, metadata: dict[str, Any] | None = None) -> bytes:
    """One frame (H, W, C) in 0..1 as a 16-bit-per-channel PNG (grey, RGB or RGBA by C), each `metadata`
    value stored as a JSON text chunk. Pillow writes 16 bits only for grey, so the file is assembled here:
    rows of big-endian samples, each behind filter byte 0, deflated into one IDAT."""
    pixels = (frame.detach().float().clamp(0, 1) * 65535.0).round().to(torch.int32).cpu().numpy()
    height, width, channels = pixels.shape
    colour_type = {1: 0, 3: 2, 4: 6}[channels]  # PNG's grey, truecolour, truecolour with alpha
    rows = pixels.astype(">u2").reshape(height, width * channels).view(np.uint8)
    raw = np.concatenate([np.zeros((height, 1), dtype=np.uint8), rows], axis=1).tobytes()
    header = struct.pack(">IIBBBBB", width, height, 16, colour_type, 0, 0, 0)
    text = b"".join(_png_chunk(b"tEXt", str(key).encode("latin-1") + b"\0" + json.dumps(value).encode("latin-1"))
                    for key, value in (metadata or {}).items())
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + text
            + _png_chunk(b"IDAT", zlib.compress(raw, compress_level)) + _png_chunk(b"IEND", b""))


def _rgb_plane(frame: Image.Image) -> np.ndarray:
    """(H, W, 3) float32 in 0..1 for any Pillow mode."""
    if frame.mode in _SIXTEEN_BIT_MODES:
        # Integer modes come from 16-bit greyscale files: their full range is 65535, not 255.
        grey = np.clip(np.asarray(frame, dtype=np.float32) / 65535.0, 0, 1)
    elif frame.mode == "F":
        grey = np.clip(np.asarray(frame, dtype=np.float32), 0, 1)
    else:
        return np.asarray(frame.convert("RGB"), dtype=np.float32) / 255.0
    return np.repeat(grey[..., None], 3, axis=-1)


def _alpha_plane(frame: Image.Image) -> np.ndarray | None:
    """(H, W) float32 opacity in 0..1, or None for an opaque frame."""
    if "A" in frame.getbands():
        return np.asarray(frame.getchannel("A"), dtype=np.float32) / 255.0
    if frame.mode == "P" and "transparency" in frame.info:  # a palette with a transparent entry
        return np.asarray(frame.convert("RGBA").getchannel("A"), dtype=np.float32) / 255.0
    return None


def check_decode_size(opened: Image.Image, name: str) -> None:
    """A ValueError when the file's frames hold more pixels, or more frames, than the caps; read from the header."""
    frames = 1 if opened.format == "MPO" else int(getattr(opened, "n_frames", 1) or 1)
    width, height = opened.size
    if frames > MAX_DECODE_FRAMES:
        raise ValueError(f"image file {name!r} has {frames} frames; at most {MAX_DECODE_FRAMES} are decoded")
    if width * height * frames > MAX_DECODE_PIXELS:
        raise ValueError(f"image file {name!r} holds {frames} frame(s) of {width}x{height} pixels, over the "
                         f"limit of {MAX_DECODE_PIXELS // 1_000_000} MP over all frames")


def load_image_file(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """An image file as (IMAGE, MASK): every frame that has the first frame's size, and 1 - alpha as the mask.

    A file without any alpha gets one zero 64x64 mask per frame, the shape ComfyUI's loader gives. The
    size caps are checked before any pixel is decoded."""
    try:
        return _decode_image_file(path)
    except (OSError, Image.DecompressionBombError) as exc:  # not a picture, cut short, or a decompression bomb
        raise ValueError(str(exc)) from exc


def _decode_image_file(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    pictures, alphas = [], []
    with Image.open(path) as opened:
        check_decode_size(opened, path.name)
        # An MPO file is a JPEG with extra pictures (a preview, a second eye), not an animation.
        frames = [opened] if opened.format == "MPO" else ImageSequence.Iterator(opened)
        first_size = None
        for number, frame in enumerate(frames, start=1):
            # Seeking reads a frame's header, not its pixels: every frame's own size is checked here,
            # before anything decodes it (a TIFF's later page may be far larger than its first).
            width, height = frame.size
            if width * height > MAX_DECODE_PIXELS:
                raise ValueError(f"image file {path.name!r}: frame {number} is {width}x{height} pixels, over "
                                 f"the limit of {MAX_DECODE_PIXELS // 1_000_000} MP")
            first_size = first_size or frame.size
            if frame.size != first_size:  # frames of another size are left out, so never decoded
                continue
            frame = ImageOps.exif_transpose(frame)
            pictures.append(_rgb_plane(frame))
            alphas.append(_alpha_plane(frame))
    if not pictures:
        raise ValueError(f"image file {path.name!r} holds no frames")
    images = torch.from_numpy(np.stack(pictures))
    if all(alpha is None for alpha in alphas):
        return images, torch.zeros((len(pictures), EMPTY_MASK_SIZE, EMPTY_MASK_SIZE), dtype=torch.float32)
    height, width = pictures[0].shape[:2]
    masks = [torch.zeros((height, width)) if alpha is None else 1.0 - torch.from_numpy(alpha) for alpha in alphas]
    return images, torch.stack(masks)


def center_crop(planes: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """The middle of (..., H, W) planes cut to the aspect ratio width:height (a view; nothing is resized).

    The side that is too long loses the same number of pixels at both ends, round(excess / 2) each.
    """
    rows, cols = planes.shape[-2], planes.shape[-1]
    have, want = cols / rows, width / height
    if have > want:  # wider than wanted: the kept width is cols * want / have
        margin = round((cols - cols * (want / have)) / 2)
        return planes[..., :, margin:cols - margin]
    if have < want:  # taller than wanted: the kept height is rows * have / want
        margin = round((rows - rows * (have / want)) / 2)
        return planes[..., margin:rows - margin, :]
    return planes


def _lanczos_planes(planes: torch.Tensor, width: int, height: int) -> torch.Tensor:
    # Pillow's Lanczos filter on float ("F") planes: no 8-bit rounding on the way.
    source = planes.detach().float().cpu().numpy()
    out = np.empty(source.shape[:2] + (height, width), dtype=np.float32)
    for item in range(source.shape[0]):
        for channel in range(source.shape[1]):
            plane = Image.fromarray(source[item, channel])
            out[item, channel] = np.asarray(plane.resize((width, height), Image.Resampling.LANCZOS))
    return torch.from_numpy(out).to(planes.device, planes.dtype)


def check_resize(width: int, height: int, method: str) -> None:
    """A ValueError unless `method` is one of UPSCALE_METHODS and the target is at least one pixel each way."""
    if method not in UPSCALE_METHODS:
        raise ValueError(f"unknown upscale method {method!r}; expected one of {', '.join(UPSCALE_METHODS)}")
    if width < 1 or height < 1:
        raise ValueError(f"target size {width}x{height} must be at least 1x1")


def resize_planes(planes: torch.Tensor, width: int, height: int, method: str) -> torch.Tensor:
    """(B, C, H, W) resized to (B, C, height, width) with one of UPSCALE_METHODS; the dtype is kept."""
    check_resize(width, height, method)
    if method == "lanczos":
        return _lanczos_planes(planes, width, height)
    corners = {"align_corners": False} if method in ("bilinear", "bicubic") else {}
    return F.interpolate(planes.float(), size=(height, width), mode=method, **corners).to(planes.dtype)


def scale_images(image: torch.Tensor, width: int, height: int, method: str, crop: str = "disabled") -> torch.Tensor:
    """An IMAGE (B, H, W, C) resized to width x height; with crop "center" it is first cut to that aspect ratio."""
    check_resize(width, height, method)
    planes = image.movedim(-1, 1)  # (B, C, H, W)
    if crop == "center":
        planes = center_crop(planes, width, height)
    out = resize_planes(planes, width, height, method)
    if method in ("bicubic", "lanczos"):
        out = out.clamp(0, 1)  # both kernels ring past the input's range; IMAGE stays within 0..1
    return out.movedim(1, -1).contiguous()


def scale_batch(batch: torch.Tensor, width: int, height: int, method: str, crop: str = "disabled") -> torch.Tensor:
    """An IMAGE (B, H, W, C) or a MASK (B, H, W) resized to width x height, as `scale_images` resizes images."""
    if batch.dim() == 4:
        return scale_images(batch, width, height, method, crop)
    planes = scale_images(batch.unsqueeze(-1), width, height, method, crop)
    return planes.squeeze(-1)
