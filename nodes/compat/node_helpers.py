"""ComfyUI's `node_helpers` basics for plugins.

Provided: pillow (open an image, retrying with truncated-image loading), hasher (the file hash
function: SHA-256), string_to_torch_dtype. Not provided: conditioning helpers
(conditioning_set_values and friends), whose data layout belongs to Weft's conditioning nodes.
"""
from __future__ import annotations

import hashlib
from typing import Any, Callable

import torch
from PIL import ImageFile, UnidentifiedImageError

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def pillow(fn: Callable[..., Any], arg: Any) -> Any:
    """`fn(arg)`, retried once with truncated-image loading on when PIL cannot read the file."""
    previous = ImageFile.LOAD_TRUNCATED_IMAGES
    try:
        return fn(arg)
    except (OSError, UnidentifiedImageError, ValueError):
        ImageFile.LOAD_TRUNCATED_IMAGES = True
        try:
            return fn(arg)
        finally:
            ImageFile.LOAD_TRUNCATED_IMAGES = previous


def hasher() -> Callable[..., Any]:
    """The hash constructor used to fingerprint files (hashlib.sha256)."""
    return hashlib.sha256


def string_to_torch_dtype(string: str) -> torch.dtype:
    """'fp32', 'fp16' or 'bf16' as a torch dtype; ValueError names the accepted strings."""
    if string not in _DTYPES:
        raise ValueError(f"unknown dtype string {string!r}; expected one of {', '.join(_DTYPES)}")
    return _DTYPES[string]

