"""`comfy_api.v0_0_3`: a pinned version name ComfyUI also answers to; in Weft it is `comfy_api.latest`."""
from comfy_api.latest import IO, UI, ComfyAPI, ComfyAPISync, ComfyExtension, Input, io, ui  # noqa: F401

__all__ = ["ComfyAPI", "ComfyAPISync", "ComfyExtension", "Input", "io", "IO", "ui", "UI"]
