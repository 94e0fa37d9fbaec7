"""`comfy_api.latest`: ComfyUI's V3 node API as Weft provides it.

Exports `io` (also `IO`: the node schema, see `_io.py`), `ui` (also `UI`: what a node shows, see
`_ui.py`), `ComfyExtension` (what a pack's `comfy_entrypoint()` returns), `Input` (type hints of the
values nodes pass) and `ComfyAPI` / `ComfyAPISync`, whose one service here is `execution.set_progress`
for the running node. ComfyUI's other services, `InputImpl` and `Types` are not provided.
"""
from __future__ import annotations

from typing import Any

import torch

from execution.context import current
from media.video import Video

from . import _io as io
from . import _ui as ui


class ComfyExtension:
    """What a pack's `comfy_entrypoint()` returns: `get_node_list()` names its node classes."""

    async def on_load(self) -> None:
        """Called once before the node list is read; a pack sets up what its nodes share here."""

    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        """The pack's node classes."""
        raise NotImplementedError(f"{type(self).__name__} does not define get_node_list()")


class Input:
    """Type hints of the values that flow between nodes."""

    Image = torch.Tensor  # (B, H, W, C) in 0..1
    Mask = torch.Tensor  # (B, H, W) in 0..1
    Latent = dict
    Audio = dict  # {"waveform": (B, C, S), "sample_rate": int}
    Video = Video


def _report_progress(value: float, max_value: float, node_id: str | None, preview_image: Any,
                     ignore_size_limit: bool) -> None:
    ctx = current()
    if not ctx.node_id:
        raise ValueError("ComfyAPI execution.set_progress: no node is running; call it from a node's execute")
    if node_id is not None and str(node_id) not in (ctx.node_id, ctx.display_node_id):
        raise ValueError(f"ComfyAPI execution.set_progress: node {node_id!r} is not the running node "
                         f"{ctx.display_node_id!r}; Weft reports progress for the running node only")
    if preview_image is not None and ignore_size_limit:
        size = preview_image.size if hasattr(preview_image, "size") and not callable(preview_image.size) \
            else tuple(preview_image.shape[-3:-1])
        preview_image = ("JPEG", preview_image, max(size))  # shown at its own size
    ctx.progress(value, max_value, preview=preview_image)


class _Execution:
    """Progress of the running node."""

    async def set_progress(self, value: float, max_value: float, node_id: str | None = None,
                           preview_image: Any = None, ignore_size_limit: bool = False) -> None:
        """Report `value` of `max_value` (with an optional PIL or IMAGE preview) for the running node."""
        _report_progress(value, max_value, node_id, preview_image, ignore_size_limit)


class _ExecutionSync:
    """Progress of the running node, without awaiting."""

    def set_progress(self, value: float, max_value: float, node_id: str | None = None,
                     preview_image: Any = None, ignore_size_limit: bool = False) -> None:
        """Report `value` of `max_value` (with an optional PIL or IMAGE preview) for the running node."""
        _report_progress(value, max_value, node_id, preview_image, ignore_size_limit)


class ComfyAPI:
    """ComfyUI's service object for nodes (async methods); Weft provides `execution.set_progress`."""

    VERSION = "latest"

    def __init__(self) -> None:
        self.execution = _Execution()


class ComfyAPISync:
    """`ComfyAPI` with plain methods."""

    VERSION = "latest"

    def __init__(self) -> None:
        self.execution = _ExecutionSync()


IO = io
UI = ui

__all__ = ["ComfyAPI", "ComfyAPISync", "ComfyExtension", "Input", "io", "IO", "ui", "UI"]
