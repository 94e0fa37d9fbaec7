"""ComfyUI's `protocol` module for plugins: `BinaryEventTypes`, the binary websocket frame types."""
from __future__ import annotations

from nodes.pack_server import BinaryEventTypes

__all__ = ["BinaryEventTypes"]
