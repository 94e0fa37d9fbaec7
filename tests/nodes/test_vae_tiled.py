"""VAEDecodeTiled (ComfyUI's node and inputs) and VAEDecode take the H3 tiled decode path."""
from __future__ import annotations

import pytest
import torch

from models.h3.make_tiny import build_tiny
from nodes import vae as vae_nodes
from models.components import VAE


@pytest.fixture(scope="module")
def video_vae():
    return VAE("video", build_tiny("video_vae"), "tiny")


def _spec(node_id):
    return next(spec for spec in vae_nodes.NODES if spec.node_id == node_id)


def test_spec_matches_comfyui():
    spec = _spec("VAEDecodeTiled")
    inputs = {i.name: i for i in spec.inputs}
    assert list(inputs) == ["samples", "vae", "tile_size", "overlap", "temporal_size", "temporal_overlap"]
    want = {"tile_size": (512, 64, 4096, 32), "overlap": (64, 0, 4096, 32), "temporal_size": (64, 8, 4096, 4),
            "temporal_overlap": (8, 4, 4096, 4)}
    for name, (default, lo, hi, step) in want.items():
        opts = inputs[name].options
        assert (opts["default"], opts["min"], opts["max"], opts["step"]) == (default, lo, hi, step), name
    assert spec.category == "_for_testing" and [o.type for o in spec.outputs] == ["IMAGE"]
    assert "short clip" in spec.description


def test_tiled_node_uses_the_h3_tiled_path(video_vae, monkeypatch):
    z = torch.randn(1, 24, 2, 20, 3, generator=torch.Generator().manual_seed(0))      # 320 x 48 pixels
    calls = []
    real = video_vae.model.decode

    def spy(latent, **kwargs):
        calls.append({k: v for k, v in kwargs.items() if k != "progress"})
        assert callable(kwargs["progress"])  # the node's bar moves tile by tile
        return real(latent, **kwargs)

    monkeypatch.setattr(video_vae.model, "decode", spy)
    # ComfyUI's defaults: 512 px tiles are capped to H3's 256 px window, 64 px overlap.
    (images,) = _spec("VAEDecodeTiled").execute({"samples": z}, video_vae, 512, 64, 64, 8)
    assert calls[-1] == {"tile_size": 256, "tile_overlap": 64}
    assert images.shape == (5, 320, 48, 3)
    # Plain VAEDecode decodes through the same path with the same 256/64 tiles: the same pixels.
    (plain,) = _spec("VAEDecode").execute({"samples": z}, video_vae)
    torch.testing.assert_close(plain, images)
    # A small tile: the overlap is held to a quarter of it, as ComfyUI does.
    _spec("VAEDecodeTiled").execute({"samples": z}, video_vae, 64, 64, 64, 8)
    assert calls[-1] == {"tile_size": 64, "tile_overlap": 16}
    assert video_vae.model.last_tile_batch >= 1


def test_tiled_node_decodes_one_image_per_single_latent(video_vae):
    z = torch.randn(2, 24, 1, 2, 2, generator=torch.Generator().manual_seed(1))
    (images,) = _spec("VAEDecodeTiled").execute({"samples": z}, video_vae, 256, 64, 64, 8)
    assert images.shape == (2, 32, 32, 3)


def test_tiled_node_refuses_an_audio_vae():
    audio = VAE("audio", build_tiny("audio_vae"), "tiny audio")
    with pytest.raises(ValueError, match="VAEDecodeTiled"):
        _spec("VAEDecodeTiled").execute({"samples": torch.zeros(1, 24, 2, 2, 2)}, audio, 512, 64, 64, 8)

