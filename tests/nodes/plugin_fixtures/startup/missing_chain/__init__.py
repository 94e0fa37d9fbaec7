"""Broken: its import chain needs several modules Weft lacks; the dry pass names them all."""
import comfy.sd  # noqa: F401  (the import stops here)

from .nodes import NODE_CLASS_MAPPINGS  # noqa: F401
