"""`comfy_api.latest`: ComfyUI's V3 node API as Weft provides it.

Exports `io` (also `IO`: the node schema, see `_io.py`), `ui` (also `UI`: what a node shows, see
`_ui.py`), `ComfyExtension` (what a pack's `comfy_entrypoint()` returns) and `Input` (type hints of the
values nodes pass). ComfyUI's `ComfyAPI` service object, `InputImpl` and `Types` are not provided.
"""
from __future__ import annotations

import torch

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


IO = io
UI = ui

__all__ = ["ComfyExtension", "Input", "io", "IO", "ui", "UI"]
