"""Broken: a syntax error in a submodule."""
from .nodes import NODE_CLASS_MAPPINGS
