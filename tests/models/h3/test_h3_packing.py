"""The packed sequence: layout, rotary positions, condition rows and their timesteps, noise-mask reduction."""
import pytest
import torch

from models.h3 import packing

F = 5.0 / 3.0


def test_target_layout_and_positions():
    layout = packing.build_layout(text_len=4, latent_t=7, latent_h=4, latent_w=6, audio_t=37)
    assert [(s.role, s.stop - s.start) for s in layout.segments] == [("text", 4), ("audio", 74), ("video", 7 * 2 * 3)]
    pos = layout.positions
    assert pos[:4, 0].tolist() == [0, 1, 2, 3] and not pos[:4, 1:].any()
    audio = pos[4:78]
    # Channel-major: the left lane's 37 frames, then the right lane's, both on the shared 40-units/s clock.
    assert audio[:37, 0].tolist() == [4 + k for k in range(37)]
    assert audio[37:, 0].tolist() == [4 + k for k in range(37)]
    assert len(set(audio[:37, 2].tolist())) == 1 and len(set(audio[37:, 2].tolist())) == 1
    assert audio[0, 2] < audio[37, 2]
    video = pos[78:].view(7, 6, 3)
    # A clip's first latent covers 1 pixel frame, the others 4 each: cumulative frames 0, 1, 5, 9, 13, 17, 18.
    assert video[:, 0, 0].tolist() == pytest.approx([4 + F * f for f in (0, 1, 5, 9, 13, 17, 18)])
    # Spatial coordinates are area-normalised and the same for every frame.
    torch.testing.assert_close(video[0, :, 1:], video[6, :, 1:])
    assert video[0, :, 2].unique().numel() == 3 and video[0, :, 1].unique().numel() == 2


def test_patchify_round_trip_and_audio_packing():
    lat = torch.randn(24, 3, 4, 6)
    rows = packing.patchify_video(lat)
    assert rows.shape == (3 * 2 * 3, 96)
    torch.testing.assert_close(rows[0].view(24, 2, 2), lat[:, 0, :2, :2])
    torch.testing.assert_close(packing.unpatchify_video(rows, 3, 2, 3), lat)
    audio = torch.randn(32, 2, 5)
    arows = packing.pack_audio(audio)
    torch.testing.assert_close(arows[:5], audio[:, 0].T)
    torch.testing.assert_close(arows[5:], audio[:, 1].T)
    torch.testing.assert_close(packing.unpack_audio(arows), audio)


def _items(frames=22, lh=4, lw=4, **kf):
    extras = {"keyframes": [kf]}
    return packing.condition_items(extras, 0, target_frames=frames, latent_h=lh, latent_w=lw, audio_t=37)


def test_keyframe_rows_positions_and_timesteps():
    first = {"frame_index": 0, "latent": torch.randn(1, 24, 1, 4, 4)}
    last = {"frame_index": -1, "latent": torch.randn(1, 24, 1, 4, 4)}
    sound = {"frame_index": 11, "audio_latent": torch.randn(1, 32, 2, 6)}
    items = packing.condition_items({"keyframes": [first, last, sound]}, 0, target_frames=22, latent_h=4, latent_w=4,
                                    audio_t=37)
    assert [i.frame_index for i in items] == [0, 21, 11]
    layout = packing.build_layout(10, 7, 4, 4, 37, items)
    roles = [(s.role, s.stop - s.start) for s in layout.segments]
    assert roles == [("text", 10), ("cond_video", 4), ("cond_video", 4), ("cond_audio", 12), ("audio", 74), ("video", 28)]
    pos = layout.positions
    assert pos[10:14, 0].tolist() == pytest.approx([10.0] * 4)
    assert pos[14:18, 0].tolist() == pytest.approx([10 + F * 21] * 4)
    assert pos[18:24, 0].tolist() == pytest.approx([10 + F * 11 + k for k in range(6)])
    # Keyframe video rows share the target's spatial grid.
    torch.testing.assert_close(pos[14:18, 1:], pos[-4:, 1:])
    t, tags = packing.row_timesteps(layout, sigma_video=0.8, sigma_audio=0.6)
    assert t[:10].tolist() == pytest.approx([0.2] * 10) and tags[:10].tolist() == [1] * 10
    assert t[10:18].tolist() == pytest.approx([0.999] * 8) and tags[10:18].tolist() == [0] * 8
    assert t[18:30].tolist() == pytest.approx([1.0] * 12) and tags[18:30].tolist() == [2] * 12
    assert t[30:104].tolist() == pytest.approx([0.4] * 74)
    assert t[104:].tolist() == pytest.approx([0.2] * 28)
    # Held every step: near the end of sampling the condition rows stay at least as clean as 0.999.
    t_late, _ = packing.row_timesteps(layout, sigma_video=0.0005, sigma_audio=0.0001)
    assert t_late[10:18].tolist() == pytest.approx([0.9995] * 8)


def test_reference_blocks_advance_the_clock():
    extras = {"references": [{"kind": "image", "latent": torch.randn(1, 24, 1, 2, 4)},
                             {"kind": "audio", "audio_latent": torch.randn(1, 32, 2, 10)},
                             {"kind": "video", "latent": torch.randn(1, 24, 2, 4, 4),
                              "audio_latent": torch.randn(1, 32, 2, 8)}]}
    items = packing.condition_items(extras, 0, target_frames=5, latent_h=4, latent_w=4, audio_t=8)
    layout = packing.build_layout(3, 2, 4, 4, 8, items)
    roles = [(s.role, s.stop - s.start) for s in layout.segments]
    assert roles == [("text", 3), ("ref_video", 2), ("ref_audio", 20), ("ref_audio", 16), ("ref_video", 8),
                     ("audio", 16), ("video", 8)]
    pos = layout.positions
    assert pos[3, 0] == 3.0                          # image at the cursor, then +1
    assert pos[5, 0] == 4.0                          # audio from 4, spans 10 units
    assert pos[25, 0] == 14.0 and pos[41, 0] == 14.0  # video block: its audio then video, same origin
    # Target origin: 14 + max(8, span of 2 latents = 5/3 * 5) = 22.
    assert layout.origin == pytest.approx(14 + max(8.0, F * 5))
    assert pos[-8, 0] == pytest.approx(layout.origin)


@pytest.mark.parametrize("kf,message", [
    ({"frame_index": 22, "latent": torch.randn(1, 24, 1, 4, 4)}, "outside the clip"),
    ({"frame_index": -23, "latent": torch.randn(1, 24, 1, 4, 4)}, "outside the clip"),
    ({"frame_index": 20, "latent": torch.randn(1, 24, 2, 4, 4)}, "covers frames 20..24"),
    ({"frame_index": 0, "latent": torch.randn(1, 24, 1, 2, 4)}, "match the target latent grid"),
    ({"frame_index": 0}, "neither"),
])
def test_keyframe_refusals(kf, message):
    with pytest.raises(ValueError, match=message):
        _items(**kf)


def test_keyframes_and_references_on_odd_grids_are_padded_to_whole_patches():
    # A 3x5 target latent is padded to 4x6 by the transformer; a 3x5 guide gets the same padding.
    guide = torch.randn(1, 24, 1, 3, 5)
    (item,) = packing.condition_items({"keyframes": [{"frame_index": 0, "latent": guide}]}, 0, target_frames=22,
                                      latent_h=4, latent_w=6, audio_t=37)
    assert tuple(item.video.shape) == (24, 1, 4, 6)
    torch.testing.assert_close(item.video[:, :, :3, :5], guide[0])
    # Circular, as the reference pads: the added row and column repeat the first ones.
    torch.testing.assert_close(item.video[:, :, 3], item.video[:, :, 0])
    torch.testing.assert_close(item.video[:, :, :, 5], item.video[:, :, :, 0])
    (ref,) = packing.condition_items({"references": [{"kind": "image", "latent": torch.randn(1, 24, 1, 3, 3)}]}, 0,
                                     target_frames=22, latent_h=4, latent_w=6, audio_t=37)
    assert tuple(ref.video.shape) == (24, 1, 4, 4)
    layout = packing.build_layout(2, 7, 4, 6, 37, [item, ref])
    assert [(s.role, s.stop - s.start) for s in layout.segments][:3] == [("text", 2), ("cond_video", 6),
                                                                         ("ref_video", 4)]


def test_video_mask_reduced_by_max_to_patch_grid():
    mask = torch.zeros(2, 4)
    mask[0, 1] = 0.3
    mask[1, 3] = 1.0
    mask[0, 2] = 0.1001
    reduced = packing.reduce_video_mask(mask, batch=1, latent_t=2, latent_h=2, latent_w=4)
    assert reduced.shape == (1, 2, 1, 2)
    assert reduced[0, 0, 0].tolist() == pytest.approx([0.3, 1.0])
    assert reduced[0, 0, 0, 1] == 1.0 and reduced[0, 1, 0, 0] == pytest.approx(0.3)
    # Pixel-resolution masks over pixel frames: max over each latent's frames and each 16x16 block.
    pix = torch.zeros(5, 32, 64)
    pix[3, 20, 40] = 0.5  # frame 3 belongs to latent 1; pixel (20, 40) -> latent (1, 2) -> patch (0, 1)
    reduced = packing.reduce_video_mask(pix, batch=1, latent_t=2, latent_h=2, latent_w=4)
    assert reduced[0, 0].abs().sum() == 0 and reduced[0, 1, 0].tolist() == [0.0, 0.5]


def test_audio_mask_per_latent_frame():
    mask = torch.zeros(1, 32, 2, 6)
    mask[0, 5, 1, 2] = 0.25
    mask[0, 0, 0, 5] = 2.0
    reduced = packing.reduce_audio_mask(mask, batch=2, audio_t=6)
    assert reduced.tolist() == [[0, 0, 0.25, 0, 0, 1.0]] * 2
    with pytest.raises(ValueError, match="does not fit"):
        packing.reduce_audio_mask(torch.ones(7), batch=1, audio_t=6)


def test_masked_rows_carry_scaled_timesteps():
    layout = packing.build_layout(2, 1, 2, 4, 3)
    vmask = torch.tensor([[[0.0, 0.5]]])
    amask = torch.tensor([1.0, 0.0, 0.25])
    t, _ = packing.row_timesteps(layout, 0.8, 0.4, vmask, amask)
    assert t[2:8].tolist() == pytest.approx([0.6, 1.0, 0.9, 0.6, 1.0, 0.9])
    # A kept video row sits where visual condition rows do: max(t_video, 0.999).
    assert t[8:].tolist() == pytest.approx([0.999, 0.6])
