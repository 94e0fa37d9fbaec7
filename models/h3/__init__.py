"""The H3 model family: transformer, video and audio VAEs, text encoder, packing and flow sampling.

Data conventions the nodes rely on
----------------------------------
LATENT (one value carries both streams)::

    {"samples": video Tensor[B, 24, T', H/16, W/16],     # normalised video latent, T' = 5n+2 for 17n+5 frames
     "audio_samples": Tensor[B, 32, 2, T_a],             # normalised audio latent, 40 frames/s, 2 stereo lanes
     "frame_rate": 24.0,                                 # pixel frames per second
     "length": int,                                      # pixel frames (17n+5)
     "noise_mask": optional video mask (1 = generate, 0 = keep), any of (H, W), (T, H, W), (B, T, H, W),
                   (B, C, T, H, W) at latent or pixel resolution and latent or pixel frame count,
     "audio_noise_mask": optional audio mask (T_a,), (B, T_a), (B, C, T_a) or (B, C, 2, T_a)}

CONDITIONING: a list with one ``[hidden Tensor[B, L, D], extras dict]`` entry. extras may hold
``"attention_mask"`` (bool Tensor[B, L], True for real tokens), ``"token_tags"`` (long Tensor[B, L], the
modality of each token: 0 for the Qwen3-VL encoder's picture and video tokens, 1 for text), ``"keyframes"`` (list of
``{"frame_index": int (negative from the end), "latent": Tensor[B|1, 24, t, h, w] | None,
"audio_latent": Tensor[B|1, 32, 2, t] | None}``; video on the target's latent grid) and ``"references"``
(list of ``{"kind": "image"|"video"|"audio", "latent": ... | None, "audio_latent": ... | None}``).

Frames: ``latent_frames(frames)`` (17n+5 -> 5n+2, 1 -> 1), ``pixel_frames(latent_t)`` (inverse),
``snap_frames(frames)`` (up to 17n+5), ``audio_latent_frames(frames, fps=24)`` (round(frames/fps*40)),
``empty_latent(width, height, length, batch=1)``.

Models: ``VideoVAE.encode(frames[B?,T,H,W,3] in 0..1) -> latent``, ``VideoVAE.decode(latent) ->
frames[B,T,H,W,3]`` (float32, 0..1); ``AudioVAE.encode(wave[B,2,S] at 32 kHz) -> latent``,
``AudioVAE.decode(latent) -> wave[B,2,S]``; ``TextEncoder.encode(texts) -> (hidden, mask)``;
``H3Transformer`` (see transformer.py). Sampling: ``sigmas(steps, denoise=1.0, shift=12.0)`` and
``sample(model, latent, conditioning, sigmas, noise_seed, sampler="euler", callback=None) -> LATENT``.
Loading: ``models.loading.load_model(path, expect=...)``; tiny weights: ``models.h3.make_tiny.write_tiny``.
"""
from models.h3.latents import (AUDIO_SAMPLE_RATE, FRAME_RATE, audio_latent_frames, empty_image_latent, empty_latent,
                               latent_frames, pixel_frames, snap_frames)
from models.h3.sampling import SAMPLERS, convert_sigma, sample, sigmas

__all__ = [
    "AUDIO_SAMPLE_RATE", "FRAME_RATE", "audio_latent_frames", "empty_image_latent", "empty_latent", "latent_frames", "pixel_frames",
    "snap_frames", "SAMPLERS", "convert_sigma", "sample", "sigmas",
]
