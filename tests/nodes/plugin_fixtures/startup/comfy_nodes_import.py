"""Broken: imports a name from ComfyUI's nodes.py, which Weft does not have."""
from nodes import common_ksampler  # noqa: F401
