"""ComfyUI's `comfy_execution.graph` for node packs: `ExecutionBlocker`, the one name packs import from it.

The rest of that module is ComfyUI's scheduler, which Weft's own executor replaces; asking for it
says so."""
from __future__ import annotations

from execution.types import ExecutionBlocker

__all__ = ["ExecutionBlocker"]


def __getattr__(name: str):
    raise AttributeError(f"comfy_execution.graph.{name} is ComfyUI's own scheduler, which Weft does not "
                         "provide; packs get only ExecutionBlocker from this module")
