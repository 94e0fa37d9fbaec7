"""ComfyUI's `comfy.utils` helpers that simple node packs use, implemented on Weft's own parts.

Provided: ProgressBar (progress and previews go to the running job's event stream, and an
interrupted job stops at the next update), PROGRESS_BAR_ENABLED, load_torch_file and save_torch_file
(safetensors only: a pickle checkpoint is refused), safetensors_header, common_upscale,
repeat_to_batch_size.
Not provided: tiled_scale, state-dict key conversion helpers, set_progress_bar_global_hook and the rest.
"""
from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import torch

from execution.context import current
from media.image import center_crop, resize_planes

PROGRESS_BAR_ENABLED = True
_SAFETENSORS_SUFFIXES = (".safetensors", ".sft")


class ProgressBar:
    """Progress of the node that created it: `update(step)` adds, `update_absolute(value)` sets.

    The running node is captured at construction, so updates from a worker thread still name it.
    `preview` is passed through to the event stream as given (ComfyUI passes ("JPEG", PIL image, max size))."""

    def __init__(self, total: int, node_id: Any = None) -> None:
        self.total = total
        self.current = 0
        self._context = current()

    def update_absolute(self, value: float, total: float | None = None, preview: Any = None) -> None:
        """Set the progress to `value` (of `total`, when given), optionally with a preview."""
        if total is not None:
            self.total = total
        self.current = min(value, self.total) if self.total else value
        self._context.progress(self.current, self.total, preview=preview)

    def update(self, value: float) -> None:
        """Advance the progress by `value` steps."""
        self.update_absolute(self.current + value)


def load_torch_file(ckpt: str | Path, safe_load: bool = True, device: Any = None,
                    return_metadata: bool = False) -> Any:
    """A safetensors file's tensors ({name: tensor}), optionally with its metadata; refuses pickles."""
    from models.loading import load_state_dict, read_header

    path = str(ckpt)
    if not path.lower().endswith(_SAFETENSORS_SUFFIXES):
        raise ValueError(f"load_torch_file: {Path(path).name} is not a .safetensors file; Weft loads only "
                         "safetensors (pickle checkpoints can run code). Convert it to safetensors first.")
    tensors = load_state_dict(path)
    if device is not None and torch.device(device).type != "cpu":
        tensors = {k: v.to(device) for k, v in tensors.items()}
    if return_metadata:
        return tensors, read_header(path).metadata
    return tensors


SAFETENSORS_HEADER_MAX_BYTES = 100 * 2**20  # a longer header is not read (ComfyUI's default bound)


def safetensors_header(safetensors_path: str | Path, max_size: int = SAFETENSORS_HEADER_MAX_BYTES) -> bytes | None:
    """The raw JSON header of a safetensors file (bytes, undecoded), or None when it is longer than
    `max_size`; ValueError when the file is too short to hold the header it declares."""
    with open(safetensors_path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise ValueError(f"safetensors_header: {Path(safetensors_path).name} is too short to be a safetensors "
                             f"file ({len(prefix)} bytes)")
        length = struct.unpack("<Q", prefix)[0]
        if length > max_size:
            return None
        header = handle.read(length)
    if len(header) < length:
        raise ValueError(f"safetensors_header: {Path(safetensors_path).name} declares a {length}-byte header but "
                         f"holds only {len(header)} bytes after the length")
    return header


def save_torch_file(sd: dict[str, torch.Tensor], ckpt: str | Path, metadata: dict[str, str] | None = None) -> None:
    """Write tensors to a safetensors file."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in sd.items()}, str(ckpt), metadata=metadata)


def common_upscale(samples: torch.Tensor, width: int, height: int, upscale_method: str, crop: str) -> torch.Tensor:
    """(B, C, H, W) images or latents resized to (B, C, height, width) by `media.image.resize_planes`.

    With crop "center" the planes are first cut to the target's aspect ratio. Lanczos output is clamped
    to 0..1, since only images (never latents) go through it."""
    if samples.dim() != 4:
        raise ValueError(f"common_upscale: samples should be (B, C, H, W); got shape {tuple(samples.shape)}")
    if width < 1 or height < 1:
        raise ValueError(f"common_upscale: target size {width}x{height} must be at least 1x1")
    if crop == "center":
        samples = center_crop(samples, width, height)
    try:
        out = resize_planes(samples, width, height, upscale_method)
    except ValueError as exc:
        raise ValueError(f"common_upscale: {exc}") from None
    return out.clamp(0, 1) if upscale_method == "lanczos" else out


def repeat_to_batch_size(tensor: torch.Tensor, batch_size: int, dim: int = 0) -> torch.Tensor:
    """Trim or tile `tensor` along `dim` to exactly `batch_size` entries."""
    size = tensor.shape[dim]
    if size > batch_size:
        return tensor.narrow(dim, 0, batch_size)
    if size < batch_size:
        repeats = [1] * tensor.dim()
        repeats[dim] = -(-batch_size // size)  # ceil
        return tensor.repeat(repeats).narrow(dim, 0, batch_size)
    return tensor
