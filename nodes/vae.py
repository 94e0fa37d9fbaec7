"""VAE nodes: pixels <-> the video half of an H3 latent, waveforms <-> its audio half.

VAEDecode on a joint audio-video LATENT decodes the video stream (`samples`); VAEDecodeAudio decodes
the audio stream (`audio_samples`). The encoders produce one stream each: VAEEncode a video LATENT
(`samples`), VAEEncodeAudio an audio LATENT (`audio_samples`).
"""
from __future__ import annotations

from typing import Any

import torch

from nodes.image import check_image
from nodes.latent import check_latent
from nodes.loaders import check_vae
from nodes.media import check_audio, match_channels, resample_waveform
from nodes.spec import Input, NodeSpec, Output


def encode_frames(node: str, vae: Any, frames: torch.Tensor, name: str = "pixels") -> torch.Tensor:
    """IMAGE frames (T, H, W, C) as one clip -> normalised video latent (1, 24, T', H/16, W/16)."""
    frames = check_image(node, frames, name)
    try:
        return vae.model.encode(frames[..., :3])
    except ValueError as exc:
        raise ValueError(f"{node}: {exc}") from None


def encode_waveform(node: str, vae: Any, audio: dict, name: str = "audio") -> torch.Tensor:
    """AUDIO -> normalised audio latent (B, 32, 2, T): resampled to the VAE's rate, made stereo."""
    audio = check_audio(node, audio, name)
    rate = vae.audio_sample_rate
    waveform = resample_waveform(audio["waveform"].float(), int(audio["sample_rate"]), rate)
    waveform = match_channels(waveform, 2, node=node)
    try:
        return vae.model.encode(waveform)
    except ValueError as exc:
        raise ValueError(f"{node}: {exc}") from None


def _vae_encode(pixels: torch.Tensor, vae: Any) -> tuple[dict]:
    from models.h3 import FRAME_RATE, pixel_frames

    vae = check_vae("VAEEncode", vae, "video")
    latent = encode_frames("VAEEncode", vae, pixels)
    return ({"samples": latent, "frame_rate": FRAME_RATE, "length": pixel_frames(latent.shape[2])},)


def _vae_decode(samples: dict, vae: Any) -> tuple[torch.Tensor]:
    vae = check_vae("VAEDecode", vae, "video")
    latent = check_latent("VAEDecode", samples)["samples"]
    try:
        frames = vae.model.decode(latent)  # (B, T, H, W, 3) float32
    except ValueError as exc:
        raise ValueError(f"VAEDecode: {exc}") from None
    # A view: batches of clips become one run of frames, as ComfyUI's IMAGE holds them.
    return (frames.reshape(-1, *frames.shape[2:]),)


def _vae_decode_tiled(samples: dict, vae: Any, tile_size: int = 512, overlap: int = 64, temporal_size: int = 64,
                      temporal_overlap: int = 8) -> tuple[torch.Tensor]:
    vae = check_vae("VAEDecodeTiled", vae, "video")
    latent = check_latent("VAEDecodeTiled", samples)["samples"]
    # H3's decoder was trained on 256 px windows (RoPE positions are relative to the window): larger tiles
    # are capped. The overlap follows ComfyUI's rule (at most a quarter of the tile) in whole 16 px steps.
    # Time is decoded in H3's own clips, so temporal_size / temporal_overlap do not apply to it.
    window = int(vae.model.config.tile_size)
    tile = max(16, min(int(tile_size), window) // 16 * 16)
    overlap = int(overlap)
    if tile < overlap * 4:
        overlap = tile // 4
    overlap = overlap // 16 * 16
    try:
        frames = vae.model.decode(latent, tile_size=tile, tile_overlap=overlap)  # (B, T, H, W, 3) float32
    except ValueError as exc:
        raise ValueError(f"VAEDecodeTiled: {exc}") from None
    return (frames.reshape(-1, *frames.shape[2:]),)


def _vae_encode_audio(audio: dict, vae: Any) -> tuple[dict]:
    vae = check_vae("VAEEncodeAudio", vae, "audio")
    return ({"audio_samples": encode_waveform("VAEEncodeAudio", vae, audio), "type": "audio"},)


def _vae_decode_audio(samples: dict, vae: Any) -> tuple[dict]:
    vae = check_vae("VAEDecodeAudio", vae, "audio")
    latent = check_latent("VAEDecodeAudio", samples, need=("audio_samples",))
    try:
        waveform = vae.model.decode(latent["audio_samples"])  # (B, 2, T_a * 800)
    except ValueError as exc:
        raise ValueError(f"VAEDecodeAudio: {exc}") from None
    rate = vae.audio_sample_rate
    if latent.get("length") and latent.get("frame_rate"):
        # The audio latent covers whole 25 ms frames; the clip lasts exactly length / frame_rate seconds.
        samples_wanted = round(float(latent["length"]) / float(latent["frame_rate"]) * rate)
        waveform = waveform[..., :samples_wanted]
    return ({"waveform": waveform, "sample_rate": rate},)


NODES = [
    NodeSpec(
        node_id="VAEEncode", display_name="VAE Encode", category="latent", python_module="nodes",
        description="Encodes images (one clip, frames in order) into the video stream of an H3 latent.",
        execute=_vae_encode,
        inputs=[Input.link("pixels", "IMAGE"), Input.link("vae", "VAE")],
        outputs=[Output("LATENT")],
    ),
    NodeSpec(
        node_id="VAEDecode", display_name="VAE Decode", category="latent", python_module="nodes",
        description="Decodes latent images back into pixel space images (the video stream of an H3 latent), in "
                    "256-pixel tiles. A lone latent frame (a single image) is decoded as the start of a short clip "
                    "and its first frame kept, which costs a short clip's decode.",
        execute=_vae_decode,
        inputs=[Input.link("samples", "LATENT", tooltip="The latent to be decoded."),
                Input.link("vae", "VAE", tooltip="The VAE model used for decoding the latent.")],
        outputs=[Output("IMAGE", tooltip="The decoded image.")],
    ),
    NodeSpec(
        node_id="VAEEncodeAudio", display_name="VAE Encode Audio", category="latent/audio",
        python_module="comfy_extras.nodes_audio",
        description="Encodes audio (resampled to 32 kHz stereo) into the audio stream of an H3 latent.",
        execute=_vae_encode_audio,
        inputs=[Input.link("audio", "AUDIO"), Input.link("vae", "VAE")],
        outputs=[Output("LATENT")],
    ),
    NodeSpec(
        node_id="VAEDecodeAudio", display_name="VAE Decode Audio", category="latent/audio",
        python_module="comfy_extras.nodes_audio",
        description="Decodes the audio stream of an H3 latent to a 32 kHz stereo waveform.",
        execute=_vae_decode_audio,
        inputs=[Input.link("samples", "LATENT"), Input.link("vae", "VAE")],
        outputs=[Output("AUDIO")],
    ),
    NodeSpec(
        node_id="VAEDecodeTiled", display_name="VAE Decode (Tiled)", category="_for_testing", python_module="nodes",
        description=("Decodes the video stream of an H3 latent in overlapping spatial tiles blended into one output, "
                     "up to 4 tiles per decoder call as free device memory allows (fewer after an out-of-memory "
                     "error; the pixels do not change). VAE Decode takes the same path with 256 px tiles. A single "
                     "latent frame (an image) is decoded as the start of a short 2-latent clip and only its first "
                     "frame is kept, so one image costs a short clip's decode."),
        execute=_vae_decode_tiled,
        inputs=[
            Input.link("samples", "LATENT"), Input.link("vae", "VAE"),
            Input.int("tile_size", 512, min=64, max=4096, step=32,
                      tooltip="Spatial tile in pixels. H3 decodes in tiles of at most 256 px, the window its decoder "
                              "was trained on; larger values use 256."),
            Input.int("overlap", 64, min=0, max=4096, step=32,
                      tooltip="Least overlap between tiles in pixels (at most a quarter of the tile); overlaps are "
                              "blended linearly and any leftover is spread over the seams in 16 px steps."),
            Input.int("temporal_size", 64, min=8, max=4096, step=4,
                      tooltip="Only used for video VAEs: Amount of frames to decode at a time. H3 decodes time in "
                              "its own 17-frame clips (5 frames blended between clips), whatever this says."),
            Input.int("temporal_overlap", 8, min=4, max=4096, step=4,
                      tooltip="Only used for video VAEs: Amount of frames to overlap. H3 blends its clips over "
                              "5 frames, whatever this says."),
        ],
        outputs=[Output("IMAGE")],
    ),
]
