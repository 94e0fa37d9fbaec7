"""Broken: a submodule raises while importing."""
from .nodes import NODE_CLASS_MAPPINGS  # noqa: F401
