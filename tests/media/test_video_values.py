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
