"""Weft's compatibility stand-in for ComfyUI's `comfy` package: only `comfy.utils` and `comfy.model_management`.

Any other `comfy.*` module is absent on purpose, so a plugin importing it fails to load with that
module named (see nodes/plugins.py)."""
