"""media.video: encoder discovery, frame rates and in-memory videos, without any node."""
from __future__ import annotations

from fractions import Fraction

import pytest
import torch

import media.video as media


def test_missing_encoder_is_refused_clearly():
    with pytest.raises(ValueError, match="no H.265 encoder.*not_a_codec"):
        media.pick_encoder("H.265", ("not_a_codec",))
    assert media.h264_encoder() in ("libx264", "h264") and media.aac_encoder() in ("aac", "libfdk_aac")


def test_frame_rates_are_exact_fractions():
    assert media.as_frame_rate(24) == Fraction(24)
    assert media.as_frame_rate(23.976) == Fraction(2997, 125)
    assert media.as_frame_rate(30000 / 1001) == Fraction(30000, 1001)
    with pytest.raises(ValueError, match="above 0"):
        media.as_frame_rate(0)
    with pytest.raises(TypeError):
        media.as_frame_rate(True)


def test_in_memory_chunks_are_views_of_the_frames():
    images = torch.rand(20, 4, 6, 3, generator=torch.Generator().manual_seed(0))
    chunks = list(media.VideoComponents(images=images).iter_frame_chunks(8))
    assert [c.shape[0] for c in chunks] == [8, 8, 4]
    assert all(c.untyped_storage().data_ptr() == images.untyped_storage().data_ptr() for c in chunks)
    with pytest.raises(ValueError, match="bit depth"):
        media.VideoComponents(images=images, bit_depth=12)


def _flat_clip(frames: int, level: float, seconds_of_sound: bool = True) -> media.VideoComponents:
    samples = int(32000 * frames / 24)
    sound = {"waveform": (torch.sin(torch.arange(samples) / 7.0) * 0.3).expand(1, 2, -1).clone(),
             "sample_rate": 32000} if seconds_of_sound else None
    return media.VideoComponents(images=torch.full((frames, 32, 48, 3), level), audio=sound, frame_rate=Fraction(24))


def test_joined_clip_is_written_from_its_parts_and_reuses_unchanged_ones(tmp_path):
    clips = [_flat_clip(22, 0.1), _flat_clip(17, 0.5), _flat_clip(17, 0.9)]
    pieces = media.EncodedPieces()
    media.write_mp4(tmp_path / "a.mp4", media.VideoConcat(clips), pieces=pieces)
    assert len(pieces) == 3 and pieces.hits == 0
    written = media.VideoFile(tmp_path / "a.mp4").get_components()
    assert written.images.shape[0] == 56
    levels = written.images.mean(dim=(1, 2, 3))
    for first, stop, level in ((0, 22, 0.1), (22, 39, 0.5), (39, 56, 0.9)):  # each part where it belongs
        assert torch.allclose(levels[first:stop], torch.full((stop - first,), level), atol=0.02)
    assert written.audio["waveform"].shape[-1] >= 32000 * 56 // 24

    # Written again with the same parts: every part reused, the same file byte for byte.
    media.write_mp4(tmp_path / "b.mp4", media.VideoConcat(clips), pieces=pieces)
    assert pieces.hits == 3
    assert (tmp_path / "a.mp4").read_bytes() == (tmp_path / "b.mp4").read_bytes()
    # Without the store the same bytes are written: the store only saves the work.
    media.write_mp4(tmp_path / "c.mp4", media.VideoConcat(clips))
    assert (tmp_path / "c.mp4").read_bytes() == (tmp_path / "a.mp4").read_bytes()


def test_a_changed_part_is_encoded_again(tmp_path):
    clips = [_flat_clip(5, 0.2), _flat_clip(5, 0.6)]
    pieces = media.EncodedPieces()
    media.write_mp4(tmp_path / "a.mp4", media.VideoConcat(clips), pieces=pieces)
    clips[1].images.fill_(0.8)  # written in place: its version counter moves, its stored piece is stale
    other = media.VideoComponents(images=torch.full((5, 32, 48, 3), 0.4), frame_rate=Fraction(24))
    media.write_mp4(tmp_path / "b.mp4", media.VideoConcat([clips[0], clips[1], other]), pieces=pieces)
    assert pieces.hits == 1
    levels = media.VideoFile(tmp_path / "b.mp4").get_components().images.mean(dim=(1, 2, 3))
    assert torch.allclose(levels, torch.tensor([0.2] * 5 + [0.8] * 5 + [0.4] * 5), atol=0.02)
    # A piece lives as long as its frames do, and the store keeps under its byte budget.
    del other
    assert len(pieces) == 2
    small = media.EncodedPieces(max_bytes=1)
    media.write_mp4(tmp_path / "c.mp4", media.VideoConcat(clips), pieces=small)
    assert len(small) == 0


def _tone_clip(frames: int, level: float, hertz: float) -> media.VideoComponents:
    samples = int(32000 * frames / 24)
    tone = (torch.sin(torch.arange(samples) * (2 * torch.pi * hertz / 32000)) * 0.3).expand(1, 2, -1).clone()
    return media.VideoComponents(images=torch.full((frames, 32, 48, 3), level), audio={"waveform": tone,
                                 "sample_rate": 32000}, frame_rate=Fraction(24))


def test_a_changed_last_part_re_encodes_only_the_end_of_the_sound(tmp_path):
    clips = [_tone_clip(22, 0.1, 440.0), _tone_clip(17, 0.5, 550.0), _tone_clip(17, 0.9, 660.0)]
    pieces = media.EncodedPieces()
    media.write_mp4(tmp_path / "a.mp4", media.VideoConcat(clips), pieces=pieces)
    assert pieces.sound_packets_copied == 0
    changed = [*clips[:2], _tone_clip(17, 0.7, 330.0)]
    media.write_mp4(tmp_path / "spliced.mp4", media.VideoConcat(changed), pieces=pieces)
    media.write_mp4(tmp_path / "fresh.mp4", media.VideoConcat(changed))
    # The sound of the first 39 frames (1.625 s, 50 AAC frames) is unchanged: most of it is copied.
    assert 40 <= pieces.sound_packets_copied <= 50
    spliced = media.VideoFile(tmp_path / "spliced.mp4").get_components()
    fresh = media.VideoFile(tmp_path / "fresh.mp4").get_components()
    assert spliced.audio["waveform"].shape == fresh.audio["waveform"].shape
    wanted = media.VideoConcat(changed).get_audio()["waveform"][0]
    span = min(wanted.shape[-1], fresh.audio["waveform"].shape[-1])
    # As close to the sound as a whole fresh encode: on average, and at the splice point (AAC frames 47-53,
    # where the fresh encoder takes over) no further off than the whole encode is at its worst moment.
    errors = [(got.audio["waveform"][0, :, :span] - wanted[:, :span]).abs() for got in (spliced, fresh)]
    assert errors[0].mean() < 1.5 * errors[1].mean()
    assert errors[0][:, 46 * 1024:54 * 1024].max() <= errors[1].max()
    levels = spliced.images.mean(dim=(1, 2, 3))
    assert torch.allclose(levels[39:], torch.full((17,), 0.7), atol=0.02)


def test_a_joined_clip_reports_progress_per_part(tmp_path):
    steps = []
    media.write_mp4(tmp_path / "a.mp4", media.VideoConcat([_flat_clip(5, 0.2), _flat_clip(17, 0.6)]),
                    progress=lambda done, total: steps.append((done, total)))
    assert steps == [(5, 22), (22, 22)]
