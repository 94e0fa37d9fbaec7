"""VAE nodes: frames to and from the picture stream of an H3 latent, sound to and from its sound stream.

An H3 LATENT may hold both streams: `samples` (picture) and `audio_samples` (sound). VAEDecode reads the
first, VAEDecodeAudio the second; VAEEncode writes a LATENT with only `samples`, VAEEncodeAudio one with
only `audio_samples`.
"""
from __future__ import annotations

from typing import Any

import torch

from execution.context import current

from media.audio import check_audio, match_channels, resample_waveform
from media.image import check_image
from nodes.latent import check_latent
from nodes.loaders import check_vae
from nodes.spec import Input, NodeSpec, Output


def encode_frames(node: str, vae: Any, frames: torch.Tensor, name: str = "pixels") -> torch.Tensor:
    """Frames (T, H, W, C) of one clip encoded by the video VAE: a normalised latent (1, 24, T', H/16, W/16)."""
    frames = check_image(node, frames, name)
    try:
        return vae.model.encode(frames[..., :3], progress=current().progress)  # a bar per clip
    except ValueError as exc:
        raise ValueError(f"{node}: {exc}") from None


def encode_waveform(node: str, vae: Any, audio: dict, name: str = "audio") -> torch.Tensor:
    """AUDIO encoded by the audio VAE after conversion to its rate and to stereo: a latent (B, 32, 2, T)."""
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
        frames = vae.model.decode(latent, progress=current().progress)  # (B, T, H, W, 3) float32; a bar per tile
    except ValueError as exc:
        raise ValueError(f"VAEDecode: {exc}") from None
    # IMAGE has no clip axis: the clips of the batch are laid end to end (a reshape, no copy).
    return (frames.reshape(-1, *frames.shape[2:]),)


def _vae_decode_tiled(samples: dict, vae: Any, tile_size: int, overlap: int, temporal_size: int,
                      temporal_overlap: int) -> tuple[torch.Tensor]:
    vae = check_vae("VAEDecodeTiled", vae, "video")
    latent = check_latent("VAEDecodeTiled", samples)["samples"]
    # The decoder's attention positions are relative to a window of the size it was trained on, so no
    # tile may exceed that window. An overlap above a quarter of the tile is cut to a quarter, then to
    # whole latent cells (16 px). Time is always split into the decoder's own clips, so the temporal
    # inputs have nothing to set.
    window = int(vae.model.config.tile_size)
    tile = max(16, min(int(tile_size), window) // 16 * 16)
    overlap = int(overlap)
    if tile < overlap * 4:
        overlap = tile // 4
    overlap = overlap // 16 * 16
    try:
        frames = vae.model.decode(latent, tile_size=tile, tile_overlap=overlap,
                                  progress=current().progress)  # (B, T, H, W, 3) float32
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
        waveform = vae.model.decode(latent["audio_samples"], progress=current().progress)  # (B, 2, T_a * 800)
    except ValueError as exc:
        raise ValueError(f"VAEDecodeAudio: {exc}") from None
    rate = vae.audio_sample_rate
    if latent.get("length") and latent.get("frame_rate"):
        # The latent spans whole 25 ms steps, so it decodes a little long: cut to length / frame_rate seconds.
        samples_wanted = round(float(latent["length"]) / float(latent["frame_rate"]) * rate)
        waveform = waveform[..., :samples_wanted]
    return ({"waveform": waveform, "sample_rate": rate},)


NODES = [
    NodeSpec(
        node_id="VAEEncode", display_name="VAE Encode", category="latent", python_module="nodes",
        description="Turns frames, read as one clip in order, into the picture stream of an H3 latent.",
        execute=_vae_encode,
        inputs=[Input.link("pixels", "IMAGE"), Input.link("vae", "VAE")],
        outputs=[Output("LATENT")],
    ),
    NodeSpec(
        node_id="VAEDecode", display_name="VAE Decode", category="latent", python_module="nodes",
        description="Turns the picture stream of an H3 latent into frames, working in 256-pixel tiles. A latent "
                    "with a single frame (one image) is decoded as the opening of a short clip, of which only the "
                    "first frame is kept, so one image costs as much as a short clip.",
        execute=_vae_decode,
        inputs=[Input.link("samples", "LATENT", tooltip="Latent whose picture stream becomes frames."),
                Input.link("vae", "VAE", tooltip="The H3 video VAE.")],
        outputs=[Output("IMAGE", tooltip="The frames, every clip of the batch in turn.")],
    ),
    NodeSpec(
        node_id="VAEEncodeAudio", display_name="VAE Encode Audio", category="latent/audio",
        python_module="comfy_extras.nodes_audio",
        description="Turns sound into the sound stream of an H3 latent; it is first converted to 32 kHz stereo.",
        execute=_vae_encode_audio,
        inputs=[Input.link("audio", "AUDIO"), Input.link("vae", "VAE")],
        outputs=[Output("LATENT")],
    ),
    NodeSpec(
        node_id="VAEDecodeAudio", display_name="VAE Decode Audio", category="latent/audio",
        python_module="comfy_extras.nodes_audio",
        description="Turns the sound stream of an H3 latent into a 32 kHz stereo waveform.",
        execute=_vae_decode_audio,
        inputs=[Input.link("samples", "LATENT"), Input.link("vae", "VAE")],
        outputs=[Output("AUDIO")],
    ),
    NodeSpec(
        node_id="VAEDecodeTiled", display_name="VAE Decode (Tiled)", category="_for_testing", python_module="nodes",
        description=("Turns the picture stream of an H3 latent into frames tile by tile; neighbouring tiles overlap "
                     "and are blended. Up to 4 tiles go through the decoder at once when device memory allows, fewer "
                     "after running out of memory, with the same pixels either way. VAE Decode is this node with "
                     "256 px tiles. A single latent frame (an image) is decoded as the opening of a short clip "
                     "of 2 latent frames and only the first frame is kept, so one image costs a short clip."),
        execute=_vae_decode_tiled,
        inputs=[
            Input.link("samples", "LATENT"), Input.link("vae", "VAE"),
            Input.int("tile_size", 512, min=64, max=4096, step=32,
                      tooltip="Tile side in pixels, at most 256: the H3 decoder's training window. A larger value "
                              "acts as 256."),
            Input.int("overlap", 64, min=0, max=4096, step=32,
                      tooltip="Smallest overlap of neighbouring tiles in pixels, capped at a quarter of the tile. "
                              "Overlaps are cross-faded; spare pixels widen the seams in 16 px steps."),
            Input.int("temporal_size", 64, min=8, max=4096, step=4,
                      tooltip="Has no effect with H3: its decoder always works through time in clips of 17 "
                              "frames, cross-fading 5 frames between clips."),
            Input.int("temporal_overlap", 8, min=4, max=4096, step=4,
                      tooltip="Has no effect with H3: its clips always overlap by 5 frames."),
        ],
        outputs=[Output("IMAGE")],
    ),
]
