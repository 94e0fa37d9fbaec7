"""Video VAE: causal encoder, shapes, temporal chunks, tiled batched decode, single-image decode."""
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from models.h3 import video_vae
from models.h3.make_tiny import build_tiny
from models.loading import load_model


@pytest.fixture(scope="module")
def vae():
    return build_tiny("video_vae")


def _frames(n, h=32, w=32, seed=0):
    return torch.rand(n, h, w, 3, generator=torch.Generator().manual_seed(seed))


def test_encoder_is_causal(vae):
    frames = _frames(22)
    base = vae.encode(frames)
    assert base.shape == (1, 24, 7, 2, 2)
    changed = frames.clone()
    changed[5] = 1.0 - changed[5]
    out = vae.encode(changed)
    # Frame 5 is encoded by latent 2 (frames 5..8) of the first clip: latents 0 and 1 cannot see it.
    assert torch.equal(out[:, :, :2], base[:, :, :2])
    assert not torch.allclose(out[:, :, 2], base[:, :, 2])
    # Each 17-frame clip is encoded on its own: the second clip (latents 5, 6) ignores frame 5 too.
    assert torch.equal(out[:, :, 5:], base[:, :, 5:])
    first = frames.clone()
    first[0] = 0.0
    assert not torch.allclose(vae.encode(first)[:, :, 0], base[:, :, 0])


def test_encode_single_image_and_refusals(vae):
    assert vae.encode(_frames(1)).shape == (1, 24, 1, 2, 2)
    with pytest.raises(ValueError, match="multiples of 16"):
        vae.encode(_frames(5, h=40))


@pytest.mark.parametrize("latent_t,frames", [(2, 5), (7, 22), (12, 39)])
def test_decode_shapes(vae, latent_t, frames):
    out = vae.decode(torch.randn(2, 24, latent_t, 2, 3))
    assert out.shape == (2, frames, 32, 48, 3) and out.dtype == torch.float32
    assert out.min() >= 0 and out.max() <= 1


def test_decode_blends_temporal_chunks(vae):
    z = torch.randn(1, 24, 12, 2, 2)
    out = vae.decode(z)
    # The first 17 frames come from chunk 0 alone (nothing later is visible to them).
    alone = vae.decode(z[:, :, :7])
    torch.testing.assert_close(out[:, :17], alone[:, :17])


def test_tile_batch_sizes_give_the_same_pixels(vae):
    z = torch.randn(1, 24, 2, 3, 4)
    outs = [vae.decode(z, tile_batch=b, tile_size=32, tile_overlap=16) for b in (1, 2, 3, 4)]
    assert vae.last_tile_batch == 4
    for other in outs[1:]:
        torch.testing.assert_close(other, outs[0], rtol=1e-5, atol=1e-5)


def test_out_of_memory_shrinks_the_tile_batch(vae, monkeypatch):
    z = torch.randn(1, 24, 2, 4, 4)
    want = vae.decode(z, tile_batch=1, tile_size=32, tile_overlap=16)
    real = vae._decode_pixels
    calls = []

    def flaky(x):
        calls.append(x.shape[0])
        if x.shape[0] > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(x)

    monkeypatch.setattr(vae, "_decode_pixels", flaky)
    got = vae.decode(z, tile_batch=4, tile_size=32, tile_overlap=16)
    assert calls[0] == 4 and calls[1] == 2 and set(calls[2:]) == {1}
    torch.testing.assert_close(got, want)


def test_auto_tile_batch_follows_free_memory(vae, monkeypatch):
    cost = vae.tile_cost_bytes(7, 16, 16)
    monkeypatch.setattr(video_vae, "_free_bytes", lambda: 2 * 10 * cost)
    assert vae.auto_tile_batch(7, 16, 16) == 4
    monkeypatch.setattr(video_vae, "_free_bytes", lambda: 2 * 2 * cost + 1)
    assert vae.auto_tile_batch(7, 16, 16) == 2
    monkeypatch.setattr(video_vae, "_free_bytes", lambda: cost // 2)
    assert vae.auto_tile_batch(7, 16, 16) == 1


class _ConvDecoder(nn.Module):
    """A conv-only stand-in decoder: receptive field of one latent pixel (16 px), smaller than the overlap."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.proj = nn.Conv3d(24, 3 * 4, 1)
        self.smooth = nn.Conv2d(3, 3, 3, padding=1, padding_mode="replicate")
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)

    def forward(self, z):
        b, _, t, h, w = z.shape
        x = self.proj(z).view(b, 3, 4, t, h, w).permute(0, 1, 3, 2, 4, 5).reshape(b, 3, 4 * t, h, w)
        x = nn.functional.interpolate(x, scale_factor=(1, 16, 16), mode="nearest")
        frames = x.permute(0, 2, 1, 3, 4).reshape(-1, 3, 16 * h, 16 * w)
        return self.smooth(frames).view(b, 4 * t, 3, 16 * h, 16 * w).permute(0, 2, 1, 3, 4)


def test_tiled_decode_equals_untiled_for_a_local_decoder():
    vae = video_vae.VideoVAE(video_vae.TINY_CONFIG)
    vae.decoder = _ConvDecoder()
    z = torch.randn(1, 24, 2, 5, 7)
    untiled = vae.decode(z, tile_size=1024)
    tiled = vae.decode(z, tile_size=48, tile_overlap=32, tile_batch=3)
    torch.testing.assert_close(tiled, untiled, rtol=1e-5, atol=1e-5)


def test_single_latent_decodes_one_image_through_a_short_clip(vae):
    z = torch.randn(1, 24, 1, 2, 3)
    out = vae.decode(z)
    assert out.shape == (1, 1, 32, 48, 3)
    # It is the first valid frame of the repeated 2-latent clip ...
    clip = vae.decode(z.expand(-1, -1, 2, -1, -1))
    torch.testing.assert_close(out[:, 0], clip[:, 0])
    # ... not the naive lone-token decode.
    vae.t1_direct = True
    try:
        direct = vae.decode(z)
    finally:
        vae.t1_direct = False
    assert direct.shape == out.shape and not torch.allclose(direct, out)


def test_direct_single_latent_path_only_with_metadata_flag(vae, tmp_path):
    state = {k: v.contiguous() for k, v in vae.state_dict().items()}
    plain_path, flagged_path = tmp_path / "plain.safetensors", tmp_path / "flagged.safetensors"
    save_file(state, plain_path, metadata={"weft_tiny": "true"})
    save_file(state, flagged_path, metadata={"h3_t1_direct": "true"})
    plain = load_model(plain_path).model
    assert plain.t1_direct is False
    flagged = load_model(flagged_path).model
    assert flagged.t1_direct is True
    z = torch.randn(1, 24, 1, 2, 2)
    assert not torch.allclose(flagged.decode(z), plain.decode(z))


def test_tile_plans_cover_and_blend_to_one():
    from models.h3 import tiling
    plan = tiling.plan_tiles(1024 // 16, 16, 4, 1)                 # 1024 px in 256 px tiles, >= 64 px overlap
    assert plan.starts[0] == 0 and plan.starts[-1] + plan.size == plan.length
    assert all(o >= 4 for o in plan.overlaps)
    assert plan.exact
    px = plan.scaled(16)
    assert px.size == 256 and all(o % 16 == 0 and o >= 64 for o in px.overlaps)
    one = tiling.plan_tiles(10, 16, 4)
    assert one.starts == (0,) and one.size == 10
    crowded = tiling.plan_tiles(25, 16, 8)                          # a large leftover: three tiles overlap
    assert not crowded.exact
    canvas = torch.zeros(25, 25)
    for i, y in enumerate(crowded.starts):
        for j, x in enumerate(crowded.starts):
            canvas[y:y + 16, x:x + 16] += 3.0 * tiling.blend_weights_2d(crowded, crowded, i, j)
    torch.testing.assert_close(tiling.normalise(canvas, crowded, crowded), torch.full((25, 25), 3.0))
    w = plan.weights(1)
    assert w[0] == 0 and w[plan.size // 2] == 1 and w[-1] == 0
