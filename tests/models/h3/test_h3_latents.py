"""Frame arithmetic of the H3 latent space."""
import pytest

from models.h3 import audio_latent_frames, empty_latent, latent_frames, pixel_frames, snap_frames


@pytest.mark.parametrize("frames,latents", [(5, 2), (22, 7), (124, 37), (1, 1), (39, 12)])
def test_latent_frames_of_valid_counts(frames, latents):
    assert latent_frames(frames) == latents
    assert pixel_frames(latents) == frames


@pytest.mark.parametrize("frames,snapped", [(1, 5), (5, 5), (6, 22), (22, 22), (23, 39), (120, 124), (124, 124)])
def test_snap_frames_rounds_up_to_17n_plus_5(frames, snapped):
    assert snap_frames(frames) == snapped
    assert (snapped - 5) % 17 == 0


def test_audio_latent_frames_at_40_per_second():
    assert audio_latent_frames(124) == 207
    assert audio_latent_frames(24) == 40
    assert audio_latent_frames(22) == 37
    assert audio_latent_frames(48, fps=48) == 40


def test_empty_latent_shapes():
    lat = empty_latent(64, 32, 20, batch=2)
    assert tuple(lat["samples"].shape) == (2, 24, 7, 2, 4)
    assert tuple(lat["audio_samples"].shape) == (2, 32, 2, 37)
    assert lat["length"] == 22 and lat["frame_rate"] == 24.0
    assert not lat["samples"].any() and not lat["audio_samples"].any()


@pytest.mark.parametrize("width,height", [(40, 32), (32, 16)])
def test_empty_latent_refuses_bad_sizes(width, height):
    with pytest.raises(ValueError, match="multiple of 16"):
        empty_latent(width, height, 5)
