"""ComfyUI's `comfy.supported_models` for plugins: the model families Weft runs, described as ComfyUI does.

Provided: `MiniMaxH3` (Weft runs the H3 family only) with ComfyUI's `unet_config`
(`{"image_model": "minimax_h3"}`), `sampling_settings` (shift 12 for video, 3 for audio, the defaults
Weft's samplers use), `supported_inference_dtypes`, `vae_key_prefix` and `text_encoder_key_prefix`
(where an all-in-one checkpoint keeps those parts), `matches(unet_config)`; and `models`, the list of
families packs iterate. ComfyUI's other well-known families (SD15, SDXL, SDXLRefiner, Flux, ...) exist
by name only, as `FamilyWeftDoesNotRun` classes outside `models`: a pack comparing a detected family
against them gets the true answer (it is not that family), and detection never returns them.
Not provided: `get_model`, `clip_target`, latent formats, any other family name.
"""
from __future__ import annotations

from typing import Any

import torch


class MiniMaxH3:
    """The MiniMax H3 audio-video family."""

    unet_config: dict[str, Any] = {"image_model": "minimax_h3"}
    unet_extra_config: dict[str, Any] = {}
    sampling_settings = {"shift": 12.0, "audio_shift": 3.0}
    supported_inference_dtypes = [torch.bfloat16, torch.float32]
    vae_key_prefix = ["vae."]
    text_encoder_key_prefix = ["text_encoders."]

    def __init__(self, unet_config: dict[str, Any]) -> None:
        self.unet_config = dict(unet_config)  # what detection found (the class's entries included)

    @classmethod
    def matches(cls, unet_config: dict[str, Any] | None, state_dict: Any = None) -> bool:
        """Whether a detected unet config is this family's (every entry of the class's config agrees)."""
        if not unet_config:
            return False
        return all(unet_config.get(key) == value for key, value in cls.unet_config.items())


models = [MiniMaxH3]


class FamilyWeftDoesNotRun:
    """A model family ComfyUI knows and Weft does not run: a name to compare against, never detected."""

    unet_config: dict[str, Any] = {}

    @classmethod
    def matches(cls, unet_config: dict[str, Any] | None, state_dict: Any = None) -> bool:
        """Never: Weft detects only the families in `models`."""
        return False


NOT_RUN = ("SD15", "SD20", "SD21UnclipL", "SD21UnclipH", "SDXLRefiner", "SDXL", "SSD1B", "SVD_img2vid", "SD3",
           "Flux", "FluxSchnell", "AuraFlow", "HunyuanVideo", "LTXV", "WAN21_T2V", "WAN21_I2V", "Lumina2",
           "HiDream", "Chroma", "QwenImage")
for _name in NOT_RUN:
    globals()[_name] = type(_name, (FamilyWeftDoesNotRun,), {"__doc__": f"ComfyUI's {_name} family, which Weft "
                                                                       "does not run (never detected)."})
del _name
