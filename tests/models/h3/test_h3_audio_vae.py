"""Audio VAE: 32 kHz stereo <-> (B, 32, 2, T) at 40 Hz, lanes independent, chunked decode."""
import pytest
import torch

from models import memory
from models.h3 import tiling
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


def _latent(t, seed=3):
    return torch.randn(1, 32, 2, t, generator=torch.Generator().manual_seed(seed))


def test_automatic_chunks_follow_free_memory_and_the_measured_frame_cost(monkeypatch):
    vae = build_tiny("audio_vae")
    z = _latent(36)
    whole = vae.decode(z, chunk_frames=36)
    assert vae.last_chunks == [(0, 36)]
    # Plenty of memory and audio shorter than the first chunk: one shot, measured on the way.
    monkeypatch.setattr(tiling, "free_bytes", lambda: 1 << 40)
    torch.testing.assert_close(vae.decode(z), whole)
    assert vae.last_chunks == [(0, 36)]
    (key, cost), = vae.frame_costs.items()
    assert cost > 0
    # Short of memory: chunks of twice the overlap, cross-faded, equal to one shot (the context covers the
    # tiny vocoder's receptive field).
    monkeypatch.setattr(tiling, "free_bytes", lambda: 0)
    assert vae.chunk_frames_for(cost, 6) == 12
    chunked = vae.decode(z, overlap_frames=6)
    assert len(vae.last_chunks) > 3 and all(b - a <= 12 for a, b in vae.last_chunks)
    assert vae.last_chunks[0][0] == 0 and vae.last_chunks[-1][1] == 36
    torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-4)
    # Room for about 30 frames per chunk at the measured cost.
    monkeypatch.setattr(tiling, "free_bytes", lambda: int((30 + 12.5) * cost / vae.CHUNK_MEMORY_SHARE))
    assert vae.chunk_frames_for(cost, 6) == 30


def test_long_audio_is_chunked_without_being_asked(monkeypatch):
    vae = build_tiny("audio_vae")
    vae.AUTO_FIRST_CHUNK = 16                     # "long" for this test: longer than the measured first chunk
    monkeypatch.setattr(tiling, "free_bytes", lambda: 1 << 40)
    z = _latent(50)
    whole = vae.decode(z, chunk_frames=50)
    got = vae.decode(z)
    assert vae.last_chunks == [(0, 16), (8, 50)]   # the measured first chunk, then the rest fits in memory
    torch.testing.assert_close(got, whole, rtol=1e-4, atol=1e-4)


def test_out_of_memory_halves_the_chunk(vae, monkeypatch):
    z = _latent(40)
    whole = vae.decode(z, chunk_frames=40)
    real = vae._decode_frames

    def short_of_memory(piece):
        if piece.shape[-1] > 24:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(piece)

    monkeypatch.setattr(vae, "_decode_frames", short_of_memory)
    got = vae.decode(z, chunk_frames=40, overlap_frames=6)
    # 40 frames fail, then 20 (+ 6 frames of context); 12 (+ 6) fit and the rest follows in 12-frame chunks.
    assert vae.last_chunks[0] == (0, 12) and len(vae.last_chunks) > 2 and vae.last_chunks[-1][1] == 40
    torch.testing.assert_close(got, whole, rtol=1e-4, atol=1e-4)


def test_decode_under_a_small_memory_budget_takes_every_weight(vae):
    z = _latent(12)
    want = vae.decode(z)
    manager = memory.configure(vram_budget_gb=0.25 / 1024, device="cpu", dtype=torch.float32)   # 256 KiB
    try:
        got = vae.decode(z)
        stats = manager.stats()
    finally:
        memory.unconfigure()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert stats.evictions > 0
    manager = memory.configure(mode="highvram", device="cpu", dtype=torch.float32)
    try:
        vae.decode(z)
        taken = {id(m) for m in manager.resident_modules()}
    finally:
        memory.unconfigure()
    owners = [vae] + [m for m in list(vae.decoder.modules()) + [vae.dec_in_proj]
                      if list(m.parameters(recurse=False)) or list(m.buffers(recurse=False))]
    missing = sorted({type(m).__name__ for m in owners if id(m) not in taken})
    assert not missing, f"weights read directly, not through take(): {missing}"


def test_an_empty_audio_stream_decodes_to_no_samples(vae):
    assert vae.decode(torch.zeros(1, 32, 2, 0)).shape == (1, 2, 0)


def test_refusals(vae):
    with pytest.raises(ValueError, match="stereo"):
        vae.encode(torch.zeros(1, 1, 800))
    with pytest.raises(ValueError, match="expects latents"):
        vae.decode(torch.zeros(1, 24, 2, 5))
