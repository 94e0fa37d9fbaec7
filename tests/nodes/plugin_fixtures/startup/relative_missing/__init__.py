"""Broken: a relative import of a module the package lacks."""
from .not_here import NODE_CLASS_MAPPINGS  # noqa: F401
