"""ComfyUI's `server` module for plugins: `PromptServer` (its `instance` is the running runtime's),
`BinaryEventTypes`, `web` (aiohttp's, as ComfyUI's server module imports it) and `uuid`. What the instance provides, and where its messages go: nodes/pack_server.py.
Any other name of ComfyUI's server module is absent, so a pack importing it fails with that name."""
from __future__ import annotations

import uuid  # noqa: F401 (ComfyUI's server module imports it; packs that re-queue call server.uuid.uuid4())
from typing import Any

from aiohttp import web  # noqa: F401 (packs write `from server import web`)

from nodes.pack_server import BinaryEventTypes, PackServer

PromptServer = PackServer  # PromptServer.instance: the installed PackServer


def __getattr__(name: str) -> Any:
    raise AttributeError(f"module 'server' (Weft compatibility layer) has no attribute {name!r}; "
                         "it provides PromptServer (with PromptServer.instance), BinaryEventTypes, web and uuid")
