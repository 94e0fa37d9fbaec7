"""Broken: imports a ComfyUI module the compatibility layer does not provide."""
import comfy.sd  # noqa: F401
