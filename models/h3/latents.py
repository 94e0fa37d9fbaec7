"""Frame arithmetic of the H3 latent space and the empty LATENT value.

Video: frames are encoded as causal 17-frame clips of 5 latents each (1 latent for the clip's first
frame, then one per 4 frames), and the last 3 latents of the whole sequence are dropped, so 17n+5
pixel frames give 5n+2 latent frames. Audio: 40 latent frames per second at 32 kHz (hop 800).
"""
from __future__ import annotations

import math

import torch

VIDEO_CHANNELS = 24
AUDIO_CHANNELS = 32
AUDIO_LANES = 2                # stereo
SPATIAL_RATIO = 16             # pixels per latent pixel
CLIP_FRAMES = 17               # pixel frames per encoder clip
CLIP_LATENTS = 5               # latent frames per encoder clip
DROPPED_LATENTS = 3            # latents dropped at the end of the sequence
FRAME_RATE = 24.0              # pixel frames per second of the released models
AUDIO_SAMPLE_RATE = 32000      # Hz
AUDIO_HOP = 800                # waveform samples per audio latent frame
AUDIO_LATENT_RATE = AUDIO_SAMPLE_RATE // AUDIO_HOP  # 40 latent frames per second


def latent_frames(frames: int) -> int:
    """Latent frames for `frames` pixel frames (17n+5 -> 5n+2; a single image -> 1)."""
    if frames < 1:
        raise ValueError(f"frame count must be at least 1, got {frames}")
    if frames == 1:
        return 1
    return CLIP_LATENTS * math.ceil(frames / CLIP_FRAMES) - DROPPED_LATENTS


def pixel_frames(latent_t: int) -> int:
    """Pixel frames the video VAE decodes from `latent_t` latent frames (5n+2 -> 17n+5; 1 -> 1)."""
    if latent_t < 1:
        raise ValueError(f"latent frame count must be at least 1, got {latent_t}")
    if latent_t == 1:
        return 1
    # Latent k covers 1 pixel frame when it starts a 17-frame clip (k % 5 == 0), else 4 frames.
    return sum(1 if k % CLIP_LATENTS == 0 else 4 for k in range(latent_t))


def snap_frames(frames: int) -> int:
    """The smallest valid frame count 17n+5 (n >= 0) that is at least `frames`."""
    frames = max(5, int(frames))
    return frames + (5 - frames % CLIP_FRAMES) % CLIP_FRAMES


def audio_latent_frames(frames: int, fps: float = FRAME_RATE) -> int:
    """Audio latent frames that span `frames` pixel frames at `fps`: round(frames / fps * 40)."""
    if fps <= 0:
        raise ValueError(f"fps must be positive, got {fps}")
    return int(math.floor(frames / fps * AUDIO_LATENT_RATE + 0.5))


def empty_latent(width: int, height: int, length: int, batch: int = 1) -> dict:
    """An all-zero H3 LATENT value for a `width` x `height` clip of `length` frames (snapped up to 17n+5)."""
    for name, value in (("width", width), ("height", height)):
        if value < 32 or value % SPATIAL_RATIO:
            raise ValueError(f"{name} must be a multiple of {SPATIAL_RATIO} and at least 32, got {value}")
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    length = snap_frames(length)
    video = torch.zeros(batch, VIDEO_CHANNELS, latent_frames(length), height // SPATIAL_RATIO, width // SPATIAL_RATIO)
    audio = torch.zeros(batch, AUDIO_CHANNELS, AUDIO_LANES, audio_latent_frames(length))
    return {"samples": video, "audio_samples": audio, "frame_rate": FRAME_RATE, "length": length}


def empty_image_latent(width: int, height: int, batch: int = 1) -> dict:
    """An all-zero H3 LATENT for `batch` single images: one latent frame ("clip start") each, no sound."""
    for name, value in (("width", width), ("height", height)):
        if value < 32 or value % SPATIAL_RATIO:
            raise ValueError(f"{name} must be a multiple of {SPATIAL_RATIO} and at least 32, got {value}")
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    video = torch.zeros(batch, VIDEO_CHANNELS, 1, height // SPATIAL_RATIO, width // SPATIAL_RATIO)
    audio = torch.zeros(batch, AUDIO_CHANNELS, AUDIO_LANES, 0)  # (B, 32, 2, 0): an image has no sound
    return {"samples": video, "audio_samples": audio, "frame_rate": FRAME_RATE, "length": 1}
