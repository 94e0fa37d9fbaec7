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

Which steps are drawn: every one the render thread keeps up with. The hand-off between the sampler and
the render thread holds one picture to draw, the newest step's: a step that arrives while a picture is
being drawn replaces the one waiting (whose step is then sent as plain progress), so the sampler never
waits for a picture and nothing queues behind a slow one. The sampler's last step is always drawn, so
the final picture is the one shown; leaving the block waits for it. The sampler node's profile row counts
the pictures drawn (`preview_pictures`) and the render thread's CPU time for them (`preview_cpu_ms`).

A picture is made as one uint8 array (the frame, resized only when it is larger than `--preview-size`,
then the audio's loudness band drawn into its bottom rows with array operations) and turned into a
PIL image once. Few Python-level calls matter here: the render thread and the sampler's thread share
Python's lock, and on tiny CPU models, where both make many small calls, they take turns on it rather
than overlapping. The taeh3 decode, the bulk of a `taesd` picture, is therefore one graph call that lets
go of the lock for its whole length (models/h3/taeh3.py, `frame_at`); bench/h3_pipeline.py's preview
section measures what is left.

Cores: a sampler on the CPU runs an OpenMP team of one thread per core, so the render thread is a busy
thread too many, and a team that has to wait for one of its members to get a core back waits at every
barrier. Once a picture takes `RENDER_CORE_SHARE` of the time between two steps (taeh3 and latent2rgb
pictures of the tiny models do; no picture beside a released-size step does), the sampler's thread runs
its team one smaller (`RenderCore`), on trial: if the next steps are slower than the one before, the team
takes the core back. The trial decides, so the share is low: it only says which pictures are worth one.
The `with` block's end puts the count back. The runtime remembers each (method, latent shape, team)'s
outcome, so later runs start with it. The sampler node's profile row notes each change (`preview_core`).
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
from models.latent_preview import cache_folder, cpu_threads_here, one_cpu_thread_here, projection_for
from nodes.preview_settings import DEFAULT_PREVIEW_SIZE, FULL_DECODE_EVERY, resolve_method

logger = logging.getLogger(__name__)

SOURCES_KEY = "preview_vaes"  # runtime services: {latent channels: the video VAE last loaded with them}
TAEH3_KEY = "preview_taeh3"  # runtime services: {(path, size, mtime): its loaded taeh3 decoder; "missing": logged}
TAEH3_FILE = "taeh3.safetensors"  # provenance: interface (the file name ComfyUI's previews look for in vae_approx)
AUDIO_BAND = 0.22  # the share of the preview's height the audio loudness band covers
AUDIO_BAND_MIN_PX = 6
# Once a picture's render-thread CPU time reaches this share of the time between two sampler steps on the
# CPU, the sampler's thread team leaves the render thread a core (RenderCore), on trial. A taeh3 picture
# of the tiny models takes about 0.4 of a step, a latent2rgb one about 0.1 (both measured slowing a 2-thread
# team beyond their own CPU time); at the released sizes a taeh3 picture is thousands of times less work
# than a step.
RENDER_CORE_SHARE = 0.05
# The smaller team is kept when its first TRIAL_STEPS steps are not all slower than SLOWER times the step
# before it; otherwise the team gets its core back (a team that scales with its cores loses more by the
# smaller team than by the busy render thread).
TRIAL_STEPS = 2
SLOWER = 1.2
CORE_CHOICES_KEY = "preview_core_choices"  # runtime services: {(method, latent shape, team): kept the core}


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
    counts = np.maximum(np.diff(edges), 1)
    levels = np.sqrt(np.add.reduceat(energy, edges[:-1]) / counts)
    top = float(levels.max())
    if top <= 0.0 or not math.isfinite(top):
        return np.zeros(levels.size)
    return levels / top


BAND_SHADE = 16  # the grey the band's background is darkened towards
BAND_DARKEN = 0.7  # how far towards it
BAR_COLOUR = (120, 220, 160)


def draw_audio_band(pixels: np.ndarray, audio: torch.Tensor) -> np.ndarray:
    """Draw the audio's loudness over time as bars along the bottom rows of `pixels` ((H, W, 3) uint8, changed
    in place and returned): the band's rows are darkened, then each column gets the bar of its stretch."""
    height, width = pixels.shape[:2]
    band = min(height, max(AUDIO_BAND_MIN_PX, round(height * AUDIO_BAND)))
    region = pixels[height - band:]
    region[...] = (region * (1.0 - BAND_DARKEN) + (BAND_SHADE * BAND_DARKEN + 0.5)).astype(np.uint8)
    levels = audio_loudness(audio, max(1, width // 2))
    if levels.size == 0:
        return pixels
    column_bin = np.minimum(np.arange(width) * levels.size // width, levels.size - 1)
    bars = np.maximum(1, np.round(levels * (band - 2))).astype(int)[column_bin]  # rows above the bottom one
    rows = np.arange(band)[:, None]
    region[rows >= band - 1 - bars[None, :]] = BAR_COLOUR
    return pixels


def audio_picture(audio: torch.Tensor, size: int) -> np.ndarray:
    """A preview of audio alone (no video to draw): its loudness band on a dark picture, (H, W, 3) uint8."""
    width = max(8, size)
    blank = np.full((max(8, width // 4), width, 3), BAND_SHADE, dtype=np.uint8)
    return draw_audio_band(blank, audio) if audio.numel() else blank


class RenderCore:
    """Whether a CPU sampler's thread team leaves the preview render thread a core, decided on the
    sampler's thread step by step (see the module docstring), and the team's count put back by `release`.

    A picture taking `RENDER_CORE_SHARE` of a step gets the core; the smaller team then runs `TRIAL_STEPS`
    steps, and if each was more than `SLOWER` times the step before, the team takes its core back. The
    runtime remembers the outcome per (method, latent shape, team), so a later run of the same kind starts
    with the smaller team, or never tries it. The node's profile row notes each change (`preview_core`)."""

    def __init__(self, ctx: RunContext, shape: tuple) -> None:
        self.ctx = ctx
        self.team = torch.get_num_threads()
        self.kind = (*shape, self.team)
        self.choices = ctx.runtime.shared(CORE_CHOICES_KEY, dict)
        self.thread = threading.get_ident()
        self.given_at: int | None = None  # the step the smaller team began at, while it runs
        self.settled = self.team < 2  # nothing more to decide in this run
        self._last: float | None = None  # when the previous step was reported
        self._trial: tuple[float, list[float]] | None = None  # (the step before, the steps since) while on trial

    def step(self, step: int, picture_cpu: float, now: float) -> None:
        """Step `step` was reported at `now` (perf_counter seconds); `picture_cpu` is the latest picture's
        render-thread CPU seconds."""
        spacing = None if self._last is None else now - self._last
        self._last = now
        if self.given_at is not None:
            if self._trial is not None and spacing is not None:
                self._judge(step, spacing)
            return
        if self.settled:
            return
        kept = self.choices.get(self.kind)
        if kept is False:
            self.settled = True
        elif kept or (spacing is not None and picture_cpu >= RENDER_CORE_SHARE * spacing):
            self._give(step, None if kept else spacing)

    def _give(self, step: int, spacing: float | None) -> None:
        if not cpu_threads_here(self.team - 1):  # one thread count for the whole process: not ours to change
            self.settled = True
            return
        self.given_at = step
        self._trial = None if spacing is None else (spacing, [])
        self.ctx.note_profile("preview_core", {"from_step": step, "sampler_threads": self.team - 1})
        logger.debug("node %s: the sampler runs %d threads from step %d, leaving the preview render a core",
                     self.ctx.node_id, self.team - 1, step)

    def _judge(self, step: int, spacing: float) -> None:
        before, since = self._trial
        since.append(spacing)
        if len(since) < TRIAL_STEPS:
            return
        self._trial = None
        kept = min(since) <= SLOWER * before
        self.choices[self.kind] = kept
        if not kept:
            self.release()
            self.settled = True
            self.ctx.note_profile("preview_core", {"back_at_step": step, "sampler_threads": self.team})
            logger.debug("node %s: the smaller sampler team was slower; the sampler takes its core back",
                         self.ctx.node_id)

    def release(self) -> None:
        """Put the sampler thread's count back (on that thread; elsewhere it cannot be reached)."""
        if self.given_at is not None and threading.get_ident() == self.thread:
            cpu_threads_here(self.team)
            self.given_at = None


class SamplerPreviews:
    """One sampler run's progress and previews. Used as `with SamplerPreviews.start(latent) as previews:`.

    With previews on, `report` hands each step to a render thread and returns: the sampler never waits for
    a picture. What is handed over (under `_wake`): `_steps`, the steps not yet sent, in order, and
    `_newest`, the newest step with something to draw (its middle latent frame and audio latent, small
    copies), which a later one replaces before it is drawn. The thread draws `_newest` and sends every
    step in `_steps` in order, the drawn one's `progress` carrying its preview, so every step's progress
    arrives, in order, each after its own preview. Leaving the block waits for the last one, so every
    preview of a node comes before the node's end.
    """

    def __init__(self, ctx: RunContext, method: str, vae: Any = None, size: int = DEFAULT_PREVIEW_SIZE,
                 taeh3: Any = None) -> None:
        self.ctx = ctx
        self.method = method
        self.vae = vae
        self.taeh3 = taeh3  # the taeh3 decoder drawing the `taesd` previews
        self.size = size
        self.failed = False
        self._steps: list[tuple[int, int]] = []  # (step, total) reported, not yet sent
        self._newest: tuple | None = None  # (step, frame, sound): the picture waiting to be drawn
        self._closed = False
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._scoped = False  # inside a `with` block, whose end is sure to run on the sampler's thread
        self._core: RenderCore | None = None  # made on the first step of latents on the CPU
        self._picture_cpu = 0.0  # the render thread's CPU seconds for its latest picture

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
        self._scoped = True
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
        if not self.failed and not (self.method == "full" and step % FULL_DECODE_EVERY and step != total):
            if self.taeh3 is not None and isinstance(video, torch.Tensor) and video.dim() == 5:
                middle = video.shape[2] // 2  # the middle latent frame, with the latents of its clip before it
                frame = video[:1, :, middle - middle % CLIP_LATENTS:middle + 1].detach().clone()
            elif self.vae is not None and isinstance(video, torch.Tensor) and video.dim() == 5:
                frame = video[0, :, video.shape[2] // 2].detach().clone()  # the middle latent frame
            if isinstance(audio, torch.Tensor) and audio.dim() >= 3:
                sound = audio[:1].detach().clone()
        with self._wake:
            self._steps.append((step, total))
            if frame is not None or sound is not None:
                self._newest = (step, frame, sound)  # an older picture not yet drawn is dropped here
            if self._thread is None:
                self._thread = threading.Thread(target=self._render_loop, name=f"weft-preview-{self.ctx.node_id}",
                                                daemon=True)
                self._thread.start()
            self._wake.notify()
        if self._scoped and isinstance(video, torch.Tensor) and video.device.type == "cpu":
            if self._core is None:
                self._core = RenderCore(self.ctx, (self.method, tuple(video.shape)))
            # The first picture of a run is left out: it may include tracing the decoder's graph.
            drawn = self.ctx.counts.get("preview_pictures", 0)
            self._core.step(step, self._picture_cpu if drawn > 1 else 0.0, time.perf_counter())

    def close(self, *, wait: bool = True) -> None:
        """Stop the render thread; with `wait`, after it has sent every step handed to it. On the sampler's
        thread, its CPU thread count is put back if previews took a core from it."""
        with self._wake:
            if not wait:
                self._steps.clear()
                self._newest = None
            self._closed = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60 if wait else 5)
        if self._core is not None:
            self._core.release()

    # render thread
    def _render_loop(self) -> None:
        one_cpu_thread_here()  # the sampler's thread team already has every core
        while True:
            with self._wake:
                while not self._steps and not self._closed:
                    self._wake.wait()
                if not self._steps:
                    return
                steps, self._steps = self._steps, []
                newest, self._newest = self._newest, None
            picture = None
            if newest is not None and not self.failed:
                try:
                    began = time.thread_time()
                    picture = self._picture(newest[1], newest[2])
                    # The node's profile row: how many pictures, and this thread's CPU for them (the row's
                    # own cpu_ms is the sampler's thread).
                    spent = time.thread_time() - began
                    self._picture_cpu = spent
                    self.ctx.count("preview_pictures")
                    self.ctx.count("preview_cpu_ms", round(spent * 1000.0, 3))
                except Exception:
                    self.failed = True
                    logger.warning("live previews stopped for node %s: rendering failed", self.ctx.node_id,
                                   exc_info=True)
            drawn = newest[0] if picture is not None else None
            for step, total in steps:
                shown = ("JPEG", picture, self.size) if step == drawn else None
                self.ctx.send_progress(step, total, preview=shown)

    def _picture(self, frame: torch.Tensor | None, sound: torch.Tensor | None = None):
        """The preview of one step as a PIL image: the frame (or a dark picture) with the audio band."""
        from PIL import Image

        if frame is None:
            return Image.fromarray(audio_picture(sound, self.size))
        if self.taeh3 is not None:  # frame: (1, C, k, h, w), its clip's latents up to the previewed one
            patch = self.taeh3.spatial_ratio
            # On the latents' device (frame_at runs without autograd); the picture comes back to the CPU.
            pixels = self.taeh3.on(frame.device).frame_at(frame.float(), frame.shape[2] - 1).cpu()
        elif self.method == "full":
            patch = int(self.vae.model.config.spatial_ratio)
            pixels = self.vae.model.decode(frame[None, :, None], tile_batch=1)[0, 0]
        else:
            patch = int(self.vae.model.config.spatial_ratio)
            projection = self._projection()  # fitted once per VAE file (announced), then remembered
            pixels = projection.to_pixels(frame) if self.method == "taesd-like" else projection.to_rgb(frame)
        array = pixels.mul(255.0).add_(0.5).clamp_(0, 255).to(torch.uint8).contiguous().numpy()
        # Never larger than the real picture nor than --preview-size on its long side.
        full_w, full_h = frame.shape[-1] * patch, frame.shape[-2] * patch
        scale = min(self.size / max(full_w, full_h), 1.0)
        target = (max(1, round(full_w * scale)), max(1, round(full_h * scale)))
        if (array.shape[1], array.shape[0]) != target:
            array = np.array(Image.fromarray(array).resize(target, Image.BILINEAR))
        if sound is not None:
            draw_audio_band(array, sound)
        return Image.fromarray(array)

    def _projection(self) -> Any:
        return projection_for(self.vae, cache_folder(self.ctx.paths.user), announce=self._announce_fit)

    def _announce_fit(self) -> None:
        self.ctx.show(text="preparing live previews: fitting the preview colours from the VAE "
                           "(once per VAE file; the sampler keeps running)")
        logger.info("%s: fitting the live-preview projection (once per VAE file)", getattr(self.vae, "name", "VAE"))
