"""Video VAE: causal encoder, shapes, temporal chunks, tiled batched decode, single-image decode."""
import pytest
import torch
from safetensors.torch import save_file

from models import memory
from models.h3 import tiling, video_vae
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


@pytest.mark.parametrize("count", [5, 3, 22, 30])
def test_last_clip_encodes_only_the_frames_its_kept_latents_see(vae, count):
    # Reference: every clip padded to 17 frames with its last frame and encoded whole, the last 3 latents
    # of the sequence dropped. encode() stops the last clip at its 5th frame (causal: the kept latents 0
    # and 1 see frames 0..4 only); a different convolution length may round differently in float32.
    frames = _frames(count)
    stats = {k: getattr(vae, k) for k in ("pixel_mean", "pixel_std", "latents_mean", "latents_std")}
    x = ((frames.permute(3, 0, 1, 2)[None] - stats["pixel_mean"]) / stats["pixel_std"])  # (1, 3, T, H, W)
    clips = []
    for start in range(0, count, 17):
        clip = x[:, :, start:start + 17]
        clip = torch.cat([clip, clip[:, :, -1:].expand(-1, -1, 17 - clip.shape[2], -1, -1)], 2)
        with torch.no_grad():
            clips.append(vae.quant_conv(vae.encoder(clip)))
    mean = torch.cat(clips, 2)[:, :24, :-3]
    reference = (mean - stats["latents_mean"].view(1, -1, 1, 1, 1)) / stats["latents_std"].view(1, -1, 1, 1, 1)
    encoded = vae.encode(frames)
    assert encoded.shape == reference.shape
    torch.testing.assert_close(encoded, reference, rtol=1e-5, atol=1e-5)


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
    outs = []
    for b in (1, 2, 3, 4):
        outs.append(vae.decode(z, tile_batch=b, tile_size=32, tile_overlap=16))
        assert vae.last_tile_batch == b and vae.last_tile_batches[0] == b
    for other in outs[1:]:
        torch.testing.assert_close(other, outs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory (simulated)"),
                                   RuntimeError("CUDA error: out of memory (simulated)")])
def test_out_of_memory_shrinks_the_tile_batch(vae, monkeypatch, error):
    z = torch.randn(1, 24, 2, 4, 4)
    want = vae.decode(z, tile_batch=1, tile_size=32, tile_overlap=16)
    real = vae._decode_pixels
    calls = []

    def flaky(x):
        calls.append(x.shape[0])
        if x.shape[0] > 1:
            raise error
        return real(x)

    monkeypatch.setattr(vae, "_decode_pixels", flaky)
    got = vae.decode(z, tile_batch=4, tile_size=32, tile_overlap=16)
    assert calls[0] == 4 and calls[1] == 2 and set(calls[2:]) == {1}
    assert vae.last_tile_batch_fallbacks == 2 and set(vae.last_tile_batches) == {1}
    torch.testing.assert_close(got, want)


def test_other_errors_are_not_retried(vae, monkeypatch):
    def broken(x):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(vae, "_decode_pixels", broken)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        vae.decode(torch.randn(1, 24, 2, 4, 4), tile_batch=4, tile_size=32, tile_overlap=16)


def test_auto_tile_batch_uses_free_memory_and_the_measured_tile_cost(monkeypatch):
    vae = build_tiny("video_vae")
    z = torch.randn(1, 24, 2, 4, 4)
    want = vae.decode(z, tile_batch=1, tile_size=32, tile_overlap=16)
    assert not vae.tile_costs                                       # an explicit batch measures nothing
    monkeypatch.setattr(tiling, "free_bytes", lambda: 1 << 40)
    got = vae.decode(z, tile_size=32, tile_overlap=16)
    # The first tile is decoded alone while its cost is measured; plenty of memory then allows 4 per call.
    assert vae.last_tile_batches[0] == 1 and max(vae.last_tile_batches) == 4
    (key, cost), = vae.tile_costs.items()
    assert key[:4] == (7, 2, 2, 1) and cost > 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Short of memory: one tile per call, same pixels.
    monkeypatch.setattr(tiling, "free_bytes", lambda: int(1.5 * cost))
    assert vae.tile_batch_for(cost) == 1
    torch.testing.assert_close(vae.decode(z, tile_size=32, tile_overlap=16), want, rtol=1e-5, atol=1e-5)
    assert set(vae.last_tile_batches) == {1}
    monkeypatch.setattr(tiling, "free_bytes", lambda: int(2.6 * cost / vae.TILE_MEMORY_SHARE))
    assert vae.tile_batch_for(cost) == 2
    # The measurement is real: a tile four times the area costs more than twice as much.
    vae.decode(torch.randn(1, 24, 2, 8, 8), tile_size=64, tile_overlap=16)
    big = vae.tile_costs[next(k for k in vae.tile_costs if k[1] == 4)]
    assert big > 2 * cost


def test_peak_measurement_counts_live_tensors_only():
    def work():
        a = torch.ones(1000)          # 4000 bytes, alive until the end
        for _ in range(3):
            b = a * 2.0               # 4000 bytes, freed before the next one exists
            del b
        return a + 1.0                # 4000 bytes more: the peak is 8000

    out, peak = tiling.measure_peak_bytes(work, "cpu")
    assert out.shape == (1000,) and peak == 8000


@pytest.fixture
def small_budget():
    memory.configure(vram_budget_gb=0.5 / 1024, device="cpu", dtype=torch.float32)   # 512 KiB
    try:
        yield memory.manager()
    finally:
        memory.unconfigure()


def test_decode_under_a_small_memory_budget(vae, small_budget):
    z = torch.randn(1, 24, 2, 4, 4)
    memory.unconfigure()
    want = vae.decode(z, tile_batch=1, tile_size=32, tile_overlap=16)
    memory.activate(small_budget)
    got = vae.decode(z, tile_size=32, tile_overlap=16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    stats = small_budget.stats()
    biggest = max(sum(t.numel() * 4 for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)))
                  for m in vae.modules())
    # Weights were streamed through the manager under its budget (at most one held module over it) ...
    assert stats.takes > 0 and stats.evictions > 0
    assert stats.peak_resident_bytes <= small_budget.budget_bytes() + biggest
    # ... and with almost nothing free, the decoder ran one tile per call.
    assert set(vae.last_tile_batches) == {1}


def test_every_decoder_weight_is_taken_through_the_manager(vae):
    manager = memory.configure(mode="highvram", device="cpu", dtype=torch.float32)
    try:
        vae.decode(torch.randn(1, 24, 2, 2, 2))
        taken = {id(m) for m in manager.resident_modules()}
    finally:
        memory.unconfigure()
    owners = [vae] + [m for m in list(vae.decoder.modules()) + [vae.post_quant_conv]
                      if list(m.parameters(recurse=False)) or list(m.buffers(recurse=False))]
    missing = [type(m).__name__ for m in owners if id(m) not in taken]
    assert not missing, f"weights read directly, not through take(): {missing}"


def test_tiled_decode_needs_less_working_memory(vae):
    z = torch.randn(1, 24, 2, 8, 8)                                  # 128 x 128 pixels
    _, untiled = tiling.measure_peak_bytes(lambda: vae.decode(z, tile_size=128), "cpu")
    _, tiled = tiling.measure_peak_bytes(lambda: vae.decode(z, tile_size=64, tile_overlap=16, tile_batch=1), "cpu")
    assert tiled < 0.5 * untiled


def test_decode_refuses_bad_tiles(vae):
    z = torch.randn(1, 24, 2, 2, 2)
    with pytest.raises(ValueError, match="multiples of 16"):
        vae.decode(z, tile_size=40)
    with pytest.raises(ValueError, match="smaller than tile_size"):
        vae.decode(z, tile_size=32, tile_overlap=32)
    with pytest.raises(ValueError, match="tile_batch"):
        vae.decode(z, tile_batch=0)


@pytest.mark.parametrize("tile_size", [256, 32])
def test_single_latent_decodes_one_image_through_a_short_clip(vae, monkeypatch, tile_size):
    z = torch.randn(1, 24, 1, 2, 3)
    canvases, frames_written = [], []
    real_init, real_add = video_vae._CanvasWriter.__init__, video_vae._CanvasWriter.add

    def spy_init(self, canvas, *args):
        canvases.append(tuple(canvas.shape))
        real_init(self, canvas, *args)

    def spy_add(self, decoded, tiles, batch, window):
        frames_written.extend([sum(b - a for a, b in window.keep)] * len(tiles))
        real_add(self, decoded, tiles, batch, window)

    monkeypatch.setattr(video_vae._CanvasWriter, "__init__", spy_init)
    monkeypatch.setattr(video_vae._CanvasWriter, "add", spy_add)
    out = vae.decode(z, tile_size=tile_size, tile_overlap=16)
    assert out.shape == (1, 1, 32, 48, 3)
    # One canvas the size of the image; tiles were cut to the one kept frame before blending.
    assert canvases == [(1, 1, 32, 48, 3)] and set(frames_written) == {1}
    assert len(frames_written) == (1 if tile_size == 256 else 2)   # tiles blended
    # It is the first frame of the repeated 2-latent clip ...
    clip = vae.decode(z.expand(-1, -1, 2, -1, -1), tile_size=tile_size, tile_overlap=16)
    torch.testing.assert_close(out[:, 0], clip[:, 0], rtol=1e-5, atol=1e-5)


def test_single_image_differs_from_the_naive_lone_token_decode(vae):
    z = torch.randn(1, 24, 1, 2, 3, generator=torch.Generator().manual_seed(5))
    out = vae.decode(z)
    # Naive: the lone token through the decoder on its own, its valid (last) frame kept.
    with torch.no_grad():
        raw = vae._decode_pixels(z * vae.latents_std.view(1, -1, 1, 1, 1) + vae.latents_mean.view(1, -1, 1, 1, 1))
        naive = (raw[:, :, -1] * vae.pixel_std[:, :, 0] + vae.pixel_mean[:, :, 0]).clamp(0, 1).permute(0, 2, 3, 1)
    assert naive.shape == out[:, 0].shape
    assert (naive - out[:, 0]).abs().max() > 1e-3
    # The flagged direct path is exactly that naive decode.
    vae.t1_direct = True
    try:
        direct = vae.decode(z)
    finally:
        vae.t1_direct = False
    torch.testing.assert_close(direct[:, 0], naive, rtol=1e-5, atol=1e-5)


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
    px = plan.scaled(16)
    assert px.size == 256 and all(o % 16 == 0 and o >= 64 for o in px.overlaps)
    one = tiling.plan_tiles(10, 16, 4)
    assert one.starts == (0,) and one.size == 10
    # The weight maps of every tile sum to 1 everywhere, also where seams crowd (three tiles along an axis).
    for a, b in [(plan, plan), (tiling.plan_tiles(25, 16, 8), tiling.plan_tiles(20, 16, 4)), (one, plan)]:
        canvas = torch.zeros(a.length, b.length)
        for i, y in enumerate(a.starts):
            for j, x in enumerate(b.starts):
                canvas[y:y + a.size, x:x + b.size] += tiling.blend_weights_2d(a, b, i, j)
        torch.testing.assert_close(canvas, torch.ones_like(canvas), rtol=0, atol=1e-6)
    w = plan.lead_ramp(1)
    assert w[0] == 0 and w[1] == 1 / plan.overlaps[0] and w[plan.overlaps[0]:].eq(1).all()
    # 1040 px in 256 px tiles: 6 tiles; the 176 px left over beyond 5 x 64 spread over the seams in 16 px steps.
    odd = tiling.plan_tiles(1040 // 16, 16, 4, 1).scaled(16)
    assert len(odd.starts) == 6 and sorted(odd.overlaps) == [96, 96, 96, 96, 112]
    assert odd.starts[-1] + odd.size == 1040
