"""Broken: imports ComfyUI's server module."""
from server import PromptServer  # noqa: F401
