"""Audio VAE: 32 kHz stereo <-> (B, 32, 2, T) at 40 Hz, lanes independent, chunked decode."""
import pytest
import torch

from models.h3.make_tiny import build_tiny


@pytest.fixture(scope="module")
def vae():
    return build_tiny("audio_vae")


def test_shapes_and_hop(vae):
    wave = torch.rand(2, 2, 800 * 10 + 123, generator=torch.Generator().manual_seed(0)) * 0.6 - 0.3
    z = vae.encode(wave)
    assert z.shape == (2, 32, 2, 11)           # padded up to whole hops of 800 samples
    out = vae.decode(z)
    assert out.shape == (2, 2, 11 * 800) and out.dtype == torch.float32
    assert out.abs().max() <= 1.0


def test_stereo_lanes_are_encoded_separately(vae):
    gen = torch.Generator().manual_seed(1)
    wave = torch.rand(1, 2, 8000, generator=gen) - 0.5
    z = vae.encode(wave)
    swapped = vae.encode(wave.flip(1))
    torch.testing.assert_close(swapped, z.flip(2))
    torch.testing.assert_close(vae.decode(z.flip(2)), vae.decode(z).flip(1))


def test_tiny_latents_have_unit_scale(vae):
    t = torch.arange(16000) / 32000
    wave = torch.stack([0.3 * torch.sin(2 * torch.pi * 330 * t), 0.2 * torch.sin(2 * torch.pi * 110 * t)])[None]
    z = vae.encode(wave)
    assert 0.3 < float(z.std()) < 3.0


def test_chunked_decode_matches_one_shot(vae):
    z = torch.randn(1, 32, 1, 20, generator=torch.Generator().manual_seed(2)).expand(-1, -1, 2, -1)
    whole = vae.decode(z)
    chunked = vae.decode(z, chunk_frames=12, overlap_frames=6)
    assert chunked.shape == whole.shape
    torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="at least twice its overlap"):
        vae.decode(z, chunk_frames=10, overlap_frames=6)


def test_refusals(vae):
    with pytest.raises(ValueError, match="stereo"):
        vae.encode(torch.zeros(1, 1, 800))
    with pytest.raises(ValueError, match="expects latents"):
        vae.decode(torch.zeros(1, 24, 2, 5))
