"""Live previews while a sampler runs: the middle latent frame as a picture, the audio as an energy strip.

A video VAE is registered for previews when VAELoader loads it (by its latent channel count, in the
runtime's shared services, which is where a runtime keeps what its runs share). Its latent-to-pixel
projection, and every cache of it, is `models/latent_preview.py`'s: this module holds no cache.

The samplers run `with SamplerPreviews.start(latent) as previews:` and call `previews.report(...)` per
step; drawing happens on a render thread, and a preview that fails is logged once and switched off for
that run, never failing the job.
"""
from __future__ import annotations

import logging
import math
import threading
from typing import Any

import numpy as np
import torch

from execution.context import RunContext, current
from models.latent_preview import projection_for
from nodes.preview_settings import DEFAULT_PREVIEW_SIZE, FULL_DECODE_EVERY, resolve_method

logger = logging.getLogger(__name__)

SOURCES_KEY = "preview_vaes"  # runtime services: {latent channels: the video VAE last loaded with them}
AUDIO_STRIP_WIDTH = 32
AUDIO_LEVELS = "▁▂▃▄▅▆▇█"

def register_vae(vae: Any) -> None:
    """Make a freshly loaded video VAE the preview source for its latents (and fit it unless previews are off)."""
    if getattr(vae, "kind", None) != "video":
        return
    ctx = current()
    channels = int(vae.model.config.latent_channels)
    ctx.runtime.shared(SOURCES_KEY, dict)[channels] = vae
    if resolve_method(ctx.runtime, ctx.extra_data) != "none":
        try:
            projection_for(vae)  # fitted while loading, so sampling never waits for it
        except Exception:  # previews are optional: a VAE that cannot be fitted still loads
            logger.warning("%s: the live-preview projection could not be fitted", vae.name, exc_info=True)


# ---------------------------------------------------------------------- per sampler run
def audio_strip(audio: torch.Tensor, width: int = AUDIO_STRIP_WIDTH) -> str:
    """An audio latent (B, C, lanes, T) as a text strip of its energy over time (first item of the batch)."""
    energy = audio[0].detach().to(device="cpu", dtype=torch.float32).numpy()
    energy = np.square(energy).reshape(-1, energy.shape[-1]).mean(axis=0)
    if energy.size == 0:
        return ""
    edges = np.linspace(0, energy.size, min(width, energy.size) + 1).round().astype(int)
    bins = np.sqrt(np.array([energy[a:b].mean() for a, b in zip(edges[:-1], edges[1:])]))
    top = float(bins.max())
    if top <= 0.0 or not math.isfinite(top):
        return AUDIO_LEVELS[0] * bins.size
    levels = np.rint(bins / top * (len(AUDIO_LEVELS) - 1)).astype(int)
    return "".join(AUDIO_LEVELS[level] for level in levels)


class SamplerPreviews:
    """One sampler run's progress and previews. Used as `with SamplerPreviews.start(latent) as previews:`.

    `report` sends the step's progress at once, in order, and hands the step's middle latent frame and
    audio latent (small copies) to a render thread that keeps only the newest: the sampler never waits
    for a picture to be drawn or encoded. Leaving the block waits for the last one, so every preview of
    a node comes before the node's end.
    """

    def __init__(self, ctx: RunContext, method: str, vae: Any = None, size: int = DEFAULT_PREVIEW_SIZE) -> None:
        self.ctx = ctx
        self.method = method
        self.vae = vae
        self.size = size
        self.failed = False
        self._pending: tuple | None = None
        self._busy = False
        self._closed = False
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    @classmethod
    def start(cls, latent: dict) -> "SamplerPreviews":
        """Previews for sampling `latent` in the running node, in the method its job asks for."""
        ctx = current()
        method = resolve_method(ctx.runtime, ctx.extra_data)
        samples = latent.get("samples")
        channels = int(samples.shape[1]) if isinstance(samples, torch.Tensor) and samples.dim() == 5 else None
        vae = ctx.runtime.shared(SOURCES_KEY, dict).get(channels)
        has_audio = isinstance(latent.get("audio_samples"), torch.Tensor)
        if vae is None and not has_audio:
            method = "none"  # nothing to draw: plain progress
        return cls(ctx, method, vae, ctx.runtime.preview_size)

    def __enter__(self) -> "SamplerPreviews":
        return self

    def __exit__(self, kind, error, trace) -> None:
        self.close(wait=kind is None)

    def report(self, step: int, total: int, denoised: dict) -> None:
        """Progress for `step`; its preview picture and audio strip follow from the render thread."""
        if self.method != "none" and not self.failed:
            video, audio = denoised.get("samples"), denoised.get("audio_samples")
            frame = None
            if self.vae is not None and isinstance(video, torch.Tensor) and video.dim() == 5:
                frame = video[0, :, video.shape[2] // 2].detach().clone()  # the middle latent frame
            if self.method == "full" and step % FULL_DECODE_EVERY and step != total:
                frame = None
            sound = audio[:1].detach().clone() if isinstance(audio, torch.Tensor) and audio.dim() >= 3 else None
            if frame is not None or sound is not None:
                self._submit((step, total, frame, sound))
        self.ctx.progress(step, total)

    def close(self, *, wait: bool = True) -> None:
        """Stop the render thread; with `wait`, after it has sent the last preview handed to it."""
        with self._wake:
            if not wait:
                self._pending = None
            self._closed = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60 if wait else 5)

    # render thread
    def _submit(self, work: tuple) -> None:
        with self._wake:
            self._pending = work  # an older step not yet drawn is skipped: the newest wins
            if self._thread is None:
                self._thread = threading.Thread(target=self._render_loop, name=f"weft-preview-{self.ctx.node_id}",
                                                daemon=True)
                self._thread.start()
            self._wake.notify()

    def _render_loop(self) -> None:
        while True:
            with self._wake:
                while self._pending is None and not self._closed:
                    self._wake.wait()
                work, self._pending = self._pending, None
                if work is None:
                    return
            if self.failed:
                continue
            try:
                self._render(*work)
            except Exception:
                self.failed = True
                logger.warning("live previews stopped for node %s: rendering failed", self.ctx.node_id,
                               exc_info=True)

    def _render(self, step: int, total: int, frame: torch.Tensor | None, sound: torch.Tensor | None) -> None:
        image = self._picture(frame) if frame is not None else None
        strip = audio_strip(sound) if sound is not None else ""
        self.ctx.show(text=f"audio {strip}" if strip else None,
                      preview=("JPEG", image, self.size) if image is not None else None)

    def _picture(self, frame: torch.Tensor):
        from PIL import Image

        patch = int(self.vae.model.config.spatial_ratio)
        if self.method == "full":
            pixels = self.vae.model.decode(frame[None, :, None], tile_batch=1)[0, 0]
        elif self.method == "taesd-like":
            pixels = projection_for(self.vae).to_pixels(frame)
        else:
            pixels = projection_for(self.vae).to_rgb(frame)
        array = (pixels.mul(255.0).add_(0.5).clamp_(0, 255)).to(torch.uint8).numpy()
        image = Image.fromarray(array)
        # Never larger than the real picture nor than --preview-size on its long side.
        full_w, full_h = frame.shape[2] * patch, frame.shape[1] * patch
        scale = min(self.size / max(full_w, full_h), 1.0)
        target = (max(1, round(full_w * scale)), max(1, round(full_h * scale)))
        if image.size != target:
            image = image.resize(target, Image.BILINEAR)
        return image
