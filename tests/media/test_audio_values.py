"""media.audio: resampling, channel and length fitting, FLAC writing, without any node."""
from __future__ import annotations

import math

import pytest
import torch

import media.audio as media
from media.video import MP4_AUDIO_SAMPLE_RATE_HZ as SR


def sine(seconds, rate, channels=2, freq=440.0):
    t = torch.arange(int(round(seconds * rate))) / rate
    rows = [0.5 * torch.sin(2 * math.pi * freq * (c + 1) * t) for c in range(channels)]
    return {"waveform": torch.stack(rows)[None].float(), "sample_rate": rate}


def test_resampling_and_channel_helpers():
    audio = sine(0.5, 44100, channels=1, freq=300.0)
    out = media.resample_audio(audio, SR)
    assert out["sample_rate"] == SR and out["waveform"].shape == (1, 1, SR // 2)
    t = torch.arange(SR // 2) / SR
    ideal = 0.5 * torch.sin(2 * math.pi * 300.0 * t)
    assert (out["waveform"][0, 0, 200:-200] - ideal[200:-200]).abs().max() < 1e-3
    stereo = media.match_channels(out["waveform"], 2)
    assert stereo.shape == (1, 2, SR // 2) and torch.equal(stereo[0, 0], stereo[0, 1])
    assert media.match_channels(stereo, 1).shape == (1, 1, SR // 2)
    with pytest.raises(ValueError, match="6 channels"):
        media.match_channels(torch.zeros(6, 10), 2, node="SaveVideo")
    assert media.fit_length(torch.ones(2, 5), 8).tolist() == [[1, 1, 1, 1, 1, 0, 0, 0]] * 2


def test_flac_round_trip_leaves_no_temporary_file(tmp_path):
    clip = sine(0.2, 44100)["waveform"][0]
    media.write_flac(tmp_path / "a.flac", clip, 44100, metadata={"prompt": {"1": {}}})
    assert [p.name for p in tmp_path.iterdir()] == ["a.flac"]
    loaded = media.decode_audio(tmp_path / "a.flac")
    assert loaded["sample_rate"] == 44100 and loaded["waveform"].shape == (1, 2, clip.shape[-1])
    assert (loaded["waveform"][0] - clip).abs().max() < 2 / 32768
    with pytest.raises(ValueError, match="1 to 8 channels"):
        media.write_flac(tmp_path / "b.flac", torch.zeros(9, 10), 44100)
    assert [p.name for p in tmp_path.iterdir()] == ["a.flac"]


def test_check_audio_names_node_and_input():
    with pytest.raises(TypeError, match="Mixer: .*'sound'"):
        media.check_audio("Mixer", {"waveform": torch.zeros(2, 10), "sample_rate": 8000}, "sound")
    with pytest.raises(TypeError, match="sample_rate"):
        media.check_audio("Mixer", {"waveform": torch.zeros(1, 2, 10), "sample_rate": 0})
