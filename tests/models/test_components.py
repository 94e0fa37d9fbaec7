"""The values on model wires (models/components.py), as node packs written for ComfyUI meet them."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch

from models.components import VAE


def test_comfyuis_vae_methods_are_refused_by_name_and_getattr_defaults_still_apply():
    vae = VAE("video", torch.nn.Linear(2, 2), "tiny_video_vae.safetensors")
    with pytest.raises(AttributeError, match=r"Weft's VAE \(tiny_video_vae.safetensors\) has no encode\(\).*"
                                             r"VAE Encode / VAE Decode nodes"):
        vae.encode(torch.zeros(1, 8, 8, 3))
    with pytest.raises(AttributeError, match="has no decode_tiled"):
        vae.decode_tiled
    # A pack probing with a default (`getattr(vae, "downscale_ratio", 8)`) gets its default.
    assert getattr(vae, "downscale_ratio", 8) == 8 and getattr(vae, "encode", None) is None
    with pytest.raises(AttributeError, match="^not_a_vae_method$"):
        vae.not_a_vae_method
    # Copies and pickles, which probe for names, are unaffected.
    for again in (copy.copy(vae), copy.deepcopy(vae), pickle.loads(pickle.dumps(vae))):
        assert (again.kind, again.name) == ("video", "tiny_video_vae.safetensors")
