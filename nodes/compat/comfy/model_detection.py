"""ComfyUI's `comfy.model_detection` for plugins: which family a checkpoint's diffusion model is.

Detection reads key names only (a header's entries with a `shape` do as well as tensors), through
the marker keys Weft's own loader recognises (`models.loading.ARCHITECTURES`).

Provided: detect_unet_config (the H3 transformer under the given key prefix gives ComfyUI's
`{"image_model": "minimax_h3"}`; anything else gives None, as ComfyUI answers for a model it does not
know), model_config_from_unet (a `comfy.supported_models` instance, or None), unet_prefix_from_state_dict.
Not provided: the UNet, DiT and text-encoder config recovery of ComfyUI's other families.
"""
from __future__ import annotations

from typing import Any

from comfy import supported_models
from models.loading import ARCHITECTURES

H3_MARKERS = ARCHITECTURES["h3_transformer"]  # both present under one prefix: an H3 transformer
DIFFUSION_MODEL_PREFIXES = ("model.diffusion_model.", "model.model.", "net.", "")


def detect_unet_config(state_dict: Any, key_prefix: str, metadata: Any = None) -> dict[str, Any] | None:
    """The diffusion model's config found under `key_prefix`, or None for a model Weft does not run.

    `metadata` is accepted for ComfyUI's signature (older packs pass a dtype name there) and not needed."""
    keys = state_dict.keys() if hasattr(state_dict, "keys") else state_dict
    if all(f"{key_prefix}{marker}" in keys for marker in H3_MARKERS):
        return dict(supported_models.MiniMaxH3.unet_config)
    return None


def model_config_from_unet(state_dict: Any, unet_key_prefix: str, use_base_if_no_match: bool = False) -> Any:
    """The supported-model instance (`comfy.supported_models`) matching the detected config, or None."""
    unet_config = detect_unet_config(state_dict, unet_key_prefix)
    if unet_config is None:
        return None
    for family in supported_models.models:
        if family.matches(unet_config, state_dict):
            return family(unet_config)
    return None


def unet_prefix_from_state_dict(state_dict: Any) -> str:
    """The key prefix the diffusion model sits under ("model.diffusion_model." in an all-in-one checkpoint)."""
    keys = list(state_dict.keys() if hasattr(state_dict, "keys") else state_dict)
    for prefix in DIFFUSION_MODEL_PREFIXES:
        if detect_unet_config(keys, prefix) is not None:
            return prefix
    return "model."
