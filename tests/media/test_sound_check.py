"""The sound check: each synthetic fault is flagged on its own figure, and clean sweeps pass."""
from __future__ import annotations

import json
import math

import pytest
import torch

from media.audio_health import DEFAULT_THRESHOLDS, check_sound

RATE = 32000


def sweep(seconds=2.0, rate=RATE, start_hz=20.0, stop_hz=12000.0, amplitude=0.7):
    """A logarithmic sine sweep (S,)."""
    t = torch.arange(int(seconds * rate), dtype=torch.float64) / rate
    growth = math.log(stop_hz / start_hz) / seconds
    phase = 2 * math.pi * start_hz * (torch.exp(growth * t) - 1) / growth
    return (amplitude * torch.sin(phase)).float()


def stereo(channel):
    return torch.stack([channel, channel])


def faults(health):
    """Which figures raised a warning, by the words each warning begins with."""
    return {line.split(":")[0].split(" ")[0] for line in health.warnings}


@pytest.mark.parametrize("rate, amplitude, seconds", [(32000, 0.7, 2.0), (48000, 0.95, 1.0), (16000, 0.3, 3.0)])
def test_clean_sine_sweeps_pass(rate, amplitude, seconds):
    health = check_sound(stereo(sweep(seconds, rate, stop_hz=rate * 0.45, amplitude=amplitude)), rate,
                         video_seconds=seconds)
    assert health.healthy, health.warnings
    assert health.clicks == 0 and health.clipping_ratio == 0.0
    assert health.channel_correlation == pytest.approx(1.0)
    assert health.rms_dbfs == pytest.approx(20 * math.log10(amplitude / math.sqrt(2)), abs=0.5)
    assert health.duration_mismatch_s == pytest.approx(0.0, abs=1e-9)
    json.dumps(health.as_dict())  # every figure is a plain JSON value


def test_mono_sweep_passes_without_a_correlation():
    health = check_sound(sweep()[None], RATE)
    assert health.healthy and health.channel_correlation is None and health.duration_mismatch_s is None


def test_dc_offset_is_flagged():
    health = check_sound(stereo(sweep(amplitude=0.5)) + 0.1, RATE)
    assert faults(health) == {"DC"} and health.dc_offset == pytest.approx(0.1, abs=0.01)


def test_offset_only_sound_is_offset_and_silent():
    health = check_sound(torch.full((2, RATE), 0.3), RATE)
    assert faults(health) == {"DC", "silent"} and health.silent


def test_clipping_is_flagged():
    health = check_sound(stereo((sweep() * 3).clamp(-1, 1)), RATE)
    assert faults(health) == {"clipping"} and health.clipping_ratio > 0.3


def test_silence_is_flagged():
    health = check_sound(torch.randn(2, RATE, generator=torch.Generator().manual_seed(0)) * 1e-4, RATE)
    assert faults(health) == {"silent"} and health.rms_dbfs < -60


def test_clicks_are_counted_and_flagged():
    base = stereo(sweep(start_hz=50, stop_hz=400, amplitude=0.4))
    clicked = base.clone()
    positions = [3000 + 6000 * k for k in range(10)]
    for position in positions:
        clicked[:, position] += 0.5  # a one-sample spike: two jumps, one click
    health = check_sound(clicked, RATE)
    assert health.clicks == len(positions) and faults(health) == {"clicks"}
    assert health.click_rate_hz == pytest.approx(len(positions) / 2.0)
    assert check_sound(base, RATE).clicks == 0


def test_step_pops_in_noise_are_counted():
    noise = torch.randn(1, 2 * RATE, generator=torch.Generator().manual_seed(1)) * 0.01
    noise[:, RATE // 2:] += 0.2  # a step: one jump far above the noise's
    noise[:, RATE:] -= 0.2
    health = check_sound(noise, RATE)
    assert health.clicks == 2 and "clicks" in faults(health)


def test_an_inverted_channel_is_flagged():
    channel = sweep()
    health = check_sound(torch.stack([channel, -channel]), RATE)
    assert faults(health) == {"channels"} and health.channel_correlation == pytest.approx(-1.0)


def test_uncorrelated_stereo_is_not_an_inverted_channel():
    noise = torch.randn(2, RATE, generator=torch.Generator().manual_seed(2)) * 0.1
    health = check_sound(noise, RATE)
    assert health.healthy, health.warnings
    assert abs(health.channel_correlation) < 0.1


@pytest.mark.parametrize("sound_seconds, video_seconds", [(2.0, 2.5), (2.5, 2.0)])
def test_a_half_second_duration_mismatch_is_flagged(sound_seconds, video_seconds):
    health = check_sound(stereo(sweep(sound_seconds)), RATE, video_seconds=video_seconds)
    assert faults(health) == {"the"}  # "the sound is 0.50 s longer/shorter than the pictures"
    assert health.duration_mismatch_s == pytest.approx(sound_seconds - video_seconds)


def test_a_mismatch_within_the_threshold_passes():
    # H3 rounds the sound to whole 25 ms latent frames: that is not a fault.
    health = check_sound(stereo(sweep(2.0)), RATE, video_seconds=2.0 + DEFAULT_THRESHOLDS.max_duration_mismatch_s / 2)
    assert health.healthy


def test_non_finite_samples_are_reported_not_raised():
    sound = stereo(sweep())
    sound[0, 100] = float("nan")
    sound[1, 200] = float("inf")
    health = check_sound(sound, RATE)
    assert health.nonfinite_samples == 2 and "2" in faults(health)
    json.dumps(health.as_dict())


def test_empty_and_malformed_sound():
    health = check_sound(torch.zeros(2, 0), RATE)
    assert health.seconds == 0 and health.silent and health.clicks == 0
    with pytest.raises(ValueError, match="channels, samples"):
        check_sound(torch.zeros(1, 2, 3), RATE)
    with pytest.raises(ValueError, match="sample rate"):
        check_sound(torch.zeros(2, 10), 0)
