"""Live previews while a sampler runs: the middle latent frame as a picture, with the audio's loudness over
time drawn along its bottom edge.

A video VAE is registered for previews when VAELoader loads it (by its latent channel count, in the
runtime's shared services, which is where a runtime keeps what its runs share). Its latent-to-pixel
projection, fitted the first time a preview is drawn, and every cache of it are `models/latent_preview.py`'s:
this module holds no cache.

The samplers run `with SamplerPreviews.start(latent) as previews:` and call `previews.report(...)` per
step; drawing happens on a render thread, which sends each step's `progress` right after that step's
preview (ComfyUI's order), and a preview that fails is logged once and switched off for that run, never
failing the job.

How often a step is drawn: the render thread draws the newest step handed to it, and only when drawing
stays within `PREVIEW_SHARE` of the wall time: after a picture that took d seconds, the next one starts no
sooner than d / PREVIEW_SHARE after it began. A step that comes sooner is sent as plain progress. The
sampler's last step is always drawn, so the final picture is the one shown. When a step takes longer
than the pictures' allowance (a real model, or a cheap method) every step is drawn; when steps come
faster than that (tiny models and taeh3 on a CPU) previews come at a steady rate instead, and a CPU the
sampler keeps busy loses at most about that share of its time to them.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

import numpy as np
import torch

from execution.context import RunContext, current
from models.h3.latents import CLIP_LATENTS
from models.latent_preview import cache_folder, one_cpu_thread_here, projection_for
from nodes.preview_settings import DEFAULT_PREVIEW_SIZE, FULL_DECODE_EVERY, resolve_method

logger = logging.getLogger(__name__)

SOURCES_KEY = "preview_vaes"  # runtime services: {latent channels: the video VAE last loaded with them}
TAEH3_KEY = "preview_taeh3"  # runtime services: {(path, size, mtime): its loaded taeh3 decoder; "missing": logged}
TAEH3_FILE = "taeh3.safetensors"  # provenance: interface (the file name ComfyUI's previews look for in vae_approx)
AUDIO_BAND = 0.22  # the share of the preview's height the audio loudness band covers
AUDIO_BAND_MIN_PX = 6
PREVIEW_SHARE = 0.05  # the most of the wall time drawing previews may take (the last step is always drawn)


def register_vae(vae: Any) -> None:
    """Make a freshly loaded video VAE the preview source for its latents (its projection is fitted when
    the first preview is drawn)."""
    if getattr(vae, "kind", None) != "video":
        return
    ctx = current()
    channels = int(vae.model.config.latent_channels)
    ctx.runtime.shared(SOURCES_KEY, dict)[channels] = vae


def taeh3_decoder(ctx: RunContext, channels: int | None) -> Any:
    """The taeh3 decoder from `models/vae_approx/taeh3.safetensors` (loaded once per file version and runtime),
    or None when there is none for latents of `channels` (the caller falls back to latent2rgb; said once)."""
    from models.h3.taeh3 import load_taeh3

    loaded = ctx.runtime.shared(TAEH3_KEY, dict)
    path = next((folder / TAEH3_FILE for folder in ctx.paths.model_dirs("vae_approx")
                 if (folder / TAEH3_FILE).is_file()), None)
    if path is None:
        if not loaded.get("missing"):
            loaded["missing"] = True
            logger.info("live previews: taesd asks for models/vae_approx/%s, which is not there; drawing latent2rgb "
                        "previews instead", TAEH3_FILE)
        return None
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key not in loaded:
        try:
            loaded[key] = load_taeh3(path)
        except (ValueError, OSError) as exc:
            logger.warning("live previews: %s cannot be used (%s); drawing latent2rgb previews instead", path, exc)
            loaded[key] = None
    decoder = loaded[key]
    if decoder is not None and channels is not None and decoder.config.latent_channels != channels:
        return None
    return decoder


# ---------------------------------------------------------------------- per sampler run
def audio_loudness(audio: torch.Tensor, bins: int) -> np.ndarray:
    """An audio latent (B, C, lanes, T) as `bins` loudness values in [0, 1] over time (first item of the
    batch; the root mean square of each stretch, relative to the loudest)."""
    energy = audio[0].detach().to(device="cpu", dtype=torch.float32).numpy()
    energy = np.square(energy).reshape(-1, energy.shape[-1]).mean(axis=0)
    if energy.size == 0 or bins < 1:
        return np.zeros(0)
    edges = np.linspace(0, energy.size, min(bins, energy.size) + 1).round().astype(int)
    levels = np.sqrt(np.array([energy[a:b].mean() for a, b in zip(edges[:-1], edges[1:])]))
    top = float(levels.max())
    if top <= 0.0 or not math.isfinite(top):
        return np.zeros(levels.size)
    return levels / top


def draw_audio_band(image: Any, audio: torch.Tensor) -> Any:
    """`image` with the audio's loudness over time drawn as bars along its bottom edge (a new image)."""
    from PIL import Image, ImageDraw

    width, height = image.size
    band = max(AUDIO_BAND_MIN_PX, round(height * AUDIO_BAND))
    if band >= height:
        band = height
    levels = audio_loudness(audio, max(1, width // 2))
    out = image.convert("RGB")
    shade = Image.new("RGB", (width, band), (16, 16, 16))
    out.paste(Image.blend(out.crop((0, height - band, width, height)), shade, 0.7), (0, height - band))
    draw = ImageDraw.Draw(out)
    step = width / max(1, levels.size)
    for index, level in enumerate(levels):
        bar = max(1, round(float(level) * (band - 2)))
        left = round(index * step)
        right = max(left, round((index + 1) * step) - 1)
        draw.rectangle((left, height - 1 - bar, right, height - 1), fill=(120, 220, 160))
    return out


def audio_picture(audio: torch.Tensor, size: int) -> Any:
    """A preview of audio alone (no video to draw): its loudness band on a dark picture."""
    from PIL import Image

    width = max(8, size)
    blank = Image.new("RGB", (width, max(8, width // 4)), (16, 16, 16))
    return draw_audio_band(blank, audio) if audio.numel() else blank


class SamplerPreviews:
    """One sampler run's progress and previews. Used as `with SamplerPreviews.start(latent) as previews:`.

    With previews on, `report` hands each step (its middle latent frame and audio latent, small copies) to
    a render thread and returns: the sampler never waits for a picture. The thread draws the newest step
    waiting and sends the steps it skipped as plain progress, then the drawn step's `progress` carrying
    its preview, so every step's progress arrives, in order, each after its own preview. Leaving the block
    waits for the last one, so every preview of a node comes before the node's end.
    """

    def __init__(self, ctx: RunContext, method: str, vae: Any = None, size: int = DEFAULT_PREVIEW_SIZE,
                 taeh3: Any = None) -> None:
        self.ctx = ctx
        self.method = method
        self.vae = vae
        self.taeh3 = taeh3  # the taeh3 decoder drawing the `taesd` previews
        self.size = size
        self.failed = False
        self._pending: list[tuple] = []
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
        taeh3 = None
        if method == "taesd":
            taeh3 = taeh3_decoder(ctx, channels)
            if taeh3 is None:
                method = "latent2rgb"
        has_audio = isinstance(latent.get("audio_samples"), torch.Tensor)
        if vae is None and taeh3 is None and not has_audio:
            method = "none"  # nothing to draw: plain progress
        return cls(ctx, method, vae, ctx.runtime.preview_size, taeh3)

    def __enter__(self) -> "SamplerPreviews":
        return self

    def __exit__(self, kind, error, trace) -> None:
        self.close(wait=kind is None)

    def report(self, step: int, total: int, denoised: dict) -> None:
        """Progress for `step`, after its preview when previews are on; checks interruption."""
        self.ctx.check_interrupted()
        if self.method == "none":
            self.ctx.send_progress(step, total)
            return
        video, audio = denoised.get("samples"), denoised.get("audio_samples")
        frame = sound = None
        if not (self.method == "full" and step % FULL_DECODE_EVERY and step != total):
            if self.taeh3 is not None and isinstance(video, torch.Tensor) and video.dim() == 5:
                middle = video.shape[2] // 2  # the middle latent frame, with the latents of its clip before it
                frame = video[:1, :, middle - middle % CLIP_LATENTS:middle + 1].detach().clone()
            elif self.vae is not None and isinstance(video, torch.Tensor) and video.dim() == 5:
                frame = video[0, :, video.shape[2] // 2].detach().clone()  # the middle latent frame
            if isinstance(audio, torch.Tensor) and audio.dim() >= 3:
                sound = audio[:1].detach().clone()
        self._submit((step, total, frame, sound))

    def close(self, *, wait: bool = True) -> None:
        """Stop the render thread; with `wait`, after it has sent every step handed to it."""
        with self._wake:
            if not wait:
                self._pending.clear()
            self._closed = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60 if wait else 5)

    # render thread
    def _submit(self, work: tuple) -> None:
        with self._wake:
            self._pending.append(work)
            if self._thread is None:
                self._thread = threading.Thread(target=self._render_loop, name=f"weft-preview-{self.ctx.node_id}",
                                                daemon=True)
                self._thread.start()
            self._wake.notify()

    def _render_loop(self) -> None:
        one_cpu_thread_here()  # the sampler's thread team already has every core
        next_picture_at = 0.0  # perf_counter time before which only the last step is drawn (PREVIEW_SHARE)
        while True:
            with self._wake:
                while not self._pending and not self._closed:
                    self._wake.wait()
                if not self._pending:
                    return
                work, self._pending = self._pending, []
            for step, total, _, _ in work[:-1]:  # older steps not drawn: the newest wins
                self.ctx.send_progress(step, total)
            step, total, frame, sound = work[-1]
            picture = None
            if not self.failed and (frame is not None or sound is not None):
                try:
                    if frame is not None and self.taeh3 is None and self.method in ("latent2rgb", "taesd-like"):
                        self._projection()  # fitted once per VAE file: not a cost of this picture
                    began = time.perf_counter()
                    if began >= next_picture_at or step >= total:
                        picture = self._picture(frame, sound)
                        next_picture_at = began + (time.perf_counter() - began) / PREVIEW_SHARE
                except Exception:
                    self.failed = True
                    logger.warning("live previews stopped for node %s: rendering failed", self.ctx.node_id,
                                   exc_info=True)
            self.ctx.send_progress(step, total, preview=("JPEG", picture, self.size) if picture is not None else None)

    def _picture(self, frame: torch.Tensor | None, sound: torch.Tensor | None):
        from PIL import Image

        if frame is None:
            return audio_picture(sound, self.size)
        if self.taeh3 is not None:  # frame: (1, C, k, h, w), its clip's latents up to the previewed one
            patch = self.taeh3.spatial_ratio
            with torch.no_grad():  # on the latents' device; the picture comes back to the CPU
                pixels = self.taeh3.on(frame.device).frame_at(frame.float(), frame.shape[2] - 1).cpu()
        elif self.method == "full":
            patch = int(self.vae.model.config.spatial_ratio)
            pixels = self.vae.model.decode(frame[None, :, None], tile_batch=1)[0, 0]
        else:
            patch = int(self.vae.model.config.spatial_ratio)
            projection = self._projection()
            pixels = projection.to_pixels(frame) if self.method == "taesd-like" else projection.to_rgb(frame)
        array = (pixels.mul(255.0).add_(0.5).clamp_(0, 255)).to(torch.uint8).numpy()
        image = Image.fromarray(array)
        # Never larger than the real picture nor than --preview-size on its long side.
        full_w, full_h = frame.shape[-1] * patch, frame.shape[-2] * patch
        scale = min(self.size / max(full_w, full_h), 1.0)
        target = (max(1, round(full_w * scale)), max(1, round(full_h * scale)))
        if image.size != target:
            image = image.resize(target, Image.BILINEAR)
        return draw_audio_band(image, sound) if sound is not None else image

    def _projection(self) -> Any:
        return projection_for(self.vae, cache_folder(self.ctx.paths.user), announce=self._announce_fit)

    def _announce_fit(self) -> None:
        self.ctx.show(text="preparing live previews: fitting the preview colours from the VAE "
                           "(once per VAE file; the sampler keeps running)")
        logger.info("%s: fitting the live-preview projection (once per VAE file)", getattr(self.vae, "name", "VAE"))
