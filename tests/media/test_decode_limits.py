"""Decoding caps: a small file that describes a huge amount of picture or sound is refused before the
memory is spent. Each attack runs in a child process under a memory limit (tests/media/memory_limit.py)."""
from __future__ import annotations

import wave
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from media.limits import DecodeLimits
from tests.media.memory_limit import run_under_memory_limit

HEADROOM_MB = 512  # far below what any of these files would decode to


def _write_black_mp4(path: Path, frames: int, width: int, height: int) -> Path:
    with av.open(str(path), "w") as container:
        track = container.add_stream("libx264", rate=24)
        track.width, track.height, track.pix_fmt = width, height, "yuv420p"
        track.options = {"preset": "ultrafast"}
        black = av.VideoFrame.from_ndarray(np.zeros((height, width, 3), np.uint8), format="rgb24")
        for _ in range(frames):
            for packet in track.encode(black):
                container.mux(packet)
        for packet in track.encode(None):
            container.mux(packet)
    return path


def _write_silent_flac(path: Path, seconds: int, rate_hz: int = 16000) -> Path:
    with av.open(str(path), "w") as container:
        track = container.add_stream("flac", rate=rate_hz, layout="mono")
        second = np.zeros((1, rate_hz), np.int16)
        for index in range(seconds):
            frame = av.AudioFrame.from_ndarray(second, format="s16", layout="mono")
            frame.sample_rate, frame.pts, frame.time_base = rate_hz, index * rate_hz, Fraction(1, rate_hz)
            for packet in track.encode(frame):
                container.mux(packet)
        for packet in track.encode(None):
            container.mux(packet)
    return path


def _write_wav(path: Path, rate_hz: int, samples: int) -> Path:
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate_hz)
        out.writeframes(bytes(2 * samples))
    return path


def _refused(outcome: dict, pattern: str) -> None:
    assert outcome["type"] == "ValueError", outcome
    assert pattern in outcome["error"], outcome
    assert outcome["added_mb"] < HEADROOM_MB / 2, outcome  # refused before the memory was spent


def test_six_hundred_black_frames_are_refused_before_decoding(tmp_path):
    video = _write_black_mp4(tmp_path / "black.mp4", 600, 640, 480)  # 2.2 GB as float pictures
    assert video.stat().st_size < 200_000
    outcome = run_under_memory_limit(
        "from nodes.media import _load_video, _get_video_components",
        f"_get_video_components(_load_video(__import__('pathlib').Path({str(video)!r}))[0])",
        headroom_mb=HEADROOM_MB)
    _refused(outcome, "--max-decode-mb")


def test_a_few_4k_frames_are_refused_before_decoding(tmp_path):
    video = _write_black_mp4(tmp_path / "uhd.mp4", 24, 3840, 2160)  # 2.4 GB as float pictures
    outcome = run_under_memory_limit(
        "from nodes.media import _load_video, _get_video_components",
        f"_get_video_components(_load_video(__import__('pathlib').Path({str(video)!r}))[0])",
        headroom_mb=HEADROOM_MB)
    _refused(outcome, "--max-decode-mb")


def test_pictures_are_counted_as_they_decode_when_the_header_states_no_count(tmp_path):
    from media.video import VideoFile

    video = VideoFile(_write_black_mp4(tmp_path / "short.mp4", 40, 64, 64),
                      DecodeLimits(max_decoded_bytes=20 * 64 * 64 * 3 * 4))
    video._frames = 0  # as a container that records no frame count reads
    with pytest.raises(ValueError, match="--max-decode-mb"):
        video.get_components()
    small = VideoFile(video.path, DecodeLimits(max_decoded_bytes=40 * 64 * 64 * 3 * 4))
    assert small.get_components().images.shape == (40, 64, 64, 3)


def test_half_an_hour_of_silence_is_refused_before_decoding(tmp_path):
    flac = _write_silent_flac(tmp_path / "silence.flac", 30 * 60)
    assert flac.stat().st_size < 2_000_000
    outcome = run_under_memory_limit(
        "from nodes.media import _load_audio",
        f"_load_audio(__import__('pathlib').Path({str(flac)!r}))", headroom_mb=HEADROOM_MB)
    _refused(outcome, "--max-media-seconds")


def test_sound_is_counted_as_it_decodes_when_the_header_states_no_length(tmp_path, monkeypatch):
    import media.audio as audio

    flac = _write_silent_flac(tmp_path / "ten.flac", 10)
    monkeypatch.setattr(audio, "declared_seconds", lambda container, track: None)
    with pytest.raises(ValueError, match="--max-decode-mb"):
        audio.decode_audio(flac, DecodeLimits(max_decoded_bytes=5 * 16000 * 4))
    assert audio.decode_audio(flac, DecodeLimits(max_decoded_bytes=11 * 16000 * 4))["waveform"].shape == (1, 1, 160000)


def test_an_absurd_sample_rate_is_refused_when_loaded_and_when_resampled(tmp_path):
    wav = _write_wav(tmp_path / "ten_hz.wav", 10, 6000)  # 10 minutes at 10 Hz, 12 KB
    outcome = run_under_memory_limit(
        "from nodes.media import _load_audio",
        f"_load_audio(__import__('pathlib').Path({str(wav)!r}))", headroom_mb=HEADROOM_MB)
    _refused(outcome, "sample rate of 10 Hz")
    # An AUDIO value made elsewhere (a node pack) with that rate, on its way into VAEEncodeAudio.
    outcome = run_under_memory_limit(
        "import torch\nfrom media.audio import resample_waveform",
        "resample_waveform(torch.zeros(1, 1, 6000), 10, 44100)", headroom_mb=HEADROOM_MB)
    _refused(outcome, "sample rate of 10 Hz")


def test_a_tiff_whose_second_page_is_huge_is_refused_before_decoding_it(tmp_path):
    tiff = tmp_path / "pages.tif"
    small = Image.new("RGB", (8, 8), (200, 10, 10))
    huge = Image.new("L", (12000, 12000))  # 144 MB as stored pixels, 1.7 GB once decoded into float RGB
    small.save(tiff, save_all=True, append_images=[huge], compression="tiff_lzw")
    del huge
    assert tiff.stat().st_size < 5_000_000
    # A tighter limit than the others: reading the page's pixels at all (144 MB, twice) passes it.
    outcome = run_under_memory_limit(
        "from media.image import load_image_file",
        f"load_image_file(__import__('pathlib').Path({str(tiff)!r}))", headroom_mb=200)
    assert outcome["type"] == "ValueError" and "frame 2 is 12000x12000" in outcome["error"], outcome
    assert outcome["added_mb"] < 100, outcome


def test_ordinary_files_still_decode_under_the_same_limit(tmp_path):
    video = _write_black_mp4(tmp_path / "ok.mp4", 17, 128, 96)
    flac = _write_silent_flac(tmp_path / "ok.flac", 2)
    outcome = run_under_memory_limit(
        "from nodes.media import _load_video, _get_video_components, _load_audio\nfrom pathlib import Path",
        f"images, _, _ = _get_video_components(_load_video(Path({str(video)!r}))[0])\n"
        f"assert tuple(images.shape) == (17, 96, 128, 3), images.shape\n"
        f"assert _load_audio(Path({str(flac)!r}))[0]['sample_rate'] == 16000",
        headroom_mb=HEADROOM_MB)
    assert outcome["type"] == "returned", outcome
