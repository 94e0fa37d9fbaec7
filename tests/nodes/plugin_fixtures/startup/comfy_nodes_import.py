"""Broken: imports a name from ComfyUI's nodes.py, which Weft does not have."""
from nodes import MAX_RESOLUTION  # noqa: F401
