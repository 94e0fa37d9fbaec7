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
