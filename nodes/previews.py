"""Live previews while a sampler runs: the middle latent frame as a picture, with the audio's loudness over
time drawn along its bottom edge.

A video VAE is registered for previews when VAELoader loads it (by its latent channel count, in the
runtime's shared services). Its latent-to-pixel projection is fitted from the VAE itself the first time a
preview is drawn (never while loading, and never when nobody asked for previews): a few seeded random
latents are decoded and a least-squares fit maps each latent pixel (its channels and a bias) to the pixel
patch it decodes to. The patch map is the `taesd-like` decoder; its mean over the patch is the
`latent2rgb` projection. The fit is kept on the VAE object, in Weft's own cache folder
(`<user>/weft-cache/preview-projections/`, one JSON file per model file, refitted when the file changes;
nothing is ever written into a models folder), or read from the model's own safetensors metadata
(`weft_latent_rgb`: `{"weights": [[r, g, b] per channel], "bias": [r, g, b]}`).

The samplers run `with SamplerPreviews.start(latent) as previews:` and call `previews.report(...)` per
step; drawing happens on a render thread, which sends each step's `progress` right after that step's
preview (ComfyUI's order), and a preview that fails is logged once and switched off for that run, never
failing the job.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from execution.context import RunContext, current
from nodes.preview_settings import DEFAULT_PREVIEW_SIZE, FULL_DECODE_EVERY, resolve_method

logger = logging.getLogger(__name__)

SOURCES_KEY = "preview_vaes"  # runtime services: {latent channels: the video VAE last loaded with them}
CACHE_FOLDER = ("weft-cache", "preview-projections")  # under the user folder: Weft's own, never a models folder
METADATA_KEY = "weft_latent_rgb"
FIT_BATCH = 1  # random latents decoded for a fit: one decoder window of 12 x 12 latent pixels gives
FIT_SIZE = 12  # 144 samples for the 25 unknowns per output of an H3 VAE (192 x 192 pixels, one tile)
FIT_SEED = 0
AUDIO_BAND = 0.22  # the share of the preview's height the audio loudness band covers
AUDIO_BAND_MIN_PX = 6

_fit_lock = threading.Lock()
# Fits by model file identity (device, inode, size, mtime): every runtime of the process, and every
# hard link of one file, shares one fit.
_fits_by_file: dict[tuple[int, int, int, int], "LatentProjection"] = {}


@dataclass(frozen=True)
class LatentProjection:
    """A linear map from one latent pixel (channels, then 1 for the bias) to its decoded pixel patch."""

    weights: torch.Tensor  # (channels + 1, patch * patch * 3), float32
    patch: int

    @property
    def channels(self) -> int:
        """Latent channels the projection reads."""
        return self.weights.shape[0] - 1

    def rgb_weights(self) -> torch.Tensor:
        """(channels + 1, 3): the patch map averaged over the patch, one colour per latent pixel."""
        return self.weights.view(self.weights.shape[0], self.patch * self.patch, 3).mean(dim=1)

    def to_rgb(self, frame: torch.Tensor) -> torch.Tensor:
        """(channels, h, w) latent -> (h, w, 3) colours in [0, 1]."""
        return self._apply(frame, self.rgb_weights()).clamp_(0.0, 1.0)

    def to_pixels(self, frame: torch.Tensor) -> torch.Tensor:
        """(channels, h, w) latent -> (h * patch, w * patch, 3) pixels in [0, 1]."""
        _, h, w = frame.shape
        p = self.patch
        patches = self._apply(frame, self.weights).view(h, w, p, p, 3)
        return patches.permute(0, 2, 1, 3, 4).reshape(h * p, w * p, 3).clamp_(0.0, 1.0)

    def _apply(self, frame: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        c, h, w = frame.shape
        if c != self.channels:
            raise ValueError(f"preview projection reads {self.channels} latent channels, the latent has {c}")
        flat = frame.detach().to(device="cpu", dtype=torch.float32).permute(1, 2, 0).reshape(h * w, c)
        return torch.addmm(weights[-1], flat, weights[:-1]).view(h, w, -1)

    def to_json(self) -> dict[str, Any]:
        """A JSON-able form (six significant digits)."""
        return {"patch": self.patch, "weights": [[float(f"{v:.6g}") for v in row] for row in self.weights.tolist()]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "LatentProjection":
        """The projection `to_json` wrote; ValueError when the data does not describe one."""
        weights = torch.tensor(data["weights"], dtype=torch.float32)
        patch = int(data["patch"])
        if weights.dim() != 2 or weights.shape[0] < 2 or weights.shape[1] != patch * patch * 3:
            raise ValueError(f"a preview projection needs (channels + 1, {patch * patch * 3}) weights")
        return cls(weights, patch)


def fit_projection(decode: Callable[[torch.Tensor], torch.Tensor], channels: int, patch: int, *,
                   batch: int = FIT_BATCH, size: int = FIT_SIZE, seed: int = FIT_SEED) -> LatentProjection:
    """Least-squares fit of latent pixel -> decoded patch from `decode` ((B, C, 1, h, w) -> (B, T, H, W, 3))."""
    generator = torch.Generator("cpu").manual_seed(seed)
    latents = torch.randn(batch, channels, 1, size, size, generator=generator)
    frames = decode(latents)
    if frames.dim() != 5 or tuple(frames.shape[2:]) != (size * patch, size * patch, 3):
        raise ValueError(f"the VAE decoded {tuple(latents.shape)} latents to {tuple(frames.shape)}, expected "
                         f"(B, T, {size * patch}, {size * patch}, 3)")
    first = frames[:, 0].to(torch.float64)
    targets = first.reshape(batch, size, patch, size, patch, 3).permute(0, 1, 3, 2, 4, 5)
    targets = targets.reshape(batch * size * size, patch * patch * 3)
    inputs = latents[:, :, 0].permute(0, 2, 3, 1).reshape(-1, channels).to(torch.float64)
    inputs = torch.cat([inputs, torch.ones(inputs.shape[0], 1, dtype=torch.float64)], dim=1)
    solution = torch.linalg.lstsq(inputs, targets).solution
    return LatentProjection(solution.to(torch.float32).contiguous(), patch)


# ---------------------------------------------------------------------- projection per VAE
def _from_metadata(vae: Any, channels: int, patch: int) -> LatentProjection | None:
    raw = (getattr(vae, "metadata", None) or {}).get(METADATA_KEY)
    if not raw:
        return None
    try:
        data = json.loads(raw)
        rgb = torch.tensor([*data["weights"], data.get("bias", [0.0, 0.0, 0.0])], dtype=torch.float32)
        if rgb.shape != (channels + 1, 3):
            raise ValueError(f"expected {channels} rows of 3 weights, got {tuple(rgb.shape)}")
    except (ValueError, KeyError, TypeError) as exc:
        logger.warning("%s: ignoring its %s metadata (%s); fitting the preview projection instead",
                       getattr(vae, "name", "VAE"), METADATA_KEY, exc)
        return None
    # A colour per latent pixel, spread over its whole patch.
    return LatentProjection(rgb.repeat(1, patch * patch).contiguous(), patch)


def _cache_path(vae: Any, cache_dir: Path | None) -> Path | None:
    """The fit's file in Weft's cache folder, named by a hash of the model file's resolved path."""
    source = getattr(vae, "path", None)
    if not source or cache_dir is None:
        return None
    digest = hashlib.sha256(str(Path(source).resolve()).encode("utf-8")).hexdigest()[:32]
    return Path(cache_dir) / f"{digest}.json"


def cache_folder(user_dir: Path) -> Path:
    """Where preview projections are cached for the user folder `user_dir`."""
    return Path(user_dir).joinpath(*CACHE_FOLDER)


def _file_identity(vae: Any) -> tuple[int, int, int, int] | None:
    try:
        stat = Path(vae.path).stat()
    except (OSError, TypeError, AttributeError):
        return None
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


def _source_stamp(vae: Any) -> list[int] | None:
    identity = _file_identity(vae)
    return None if identity is None else [identity[2], identity[3]]  # size and mtime survive a copy


def _from_disk(vae: Any, cache_dir: Path | None, channels: int, patch: int) -> LatentProjection | None:
    path = _cache_path(vae, cache_dir)
    if path is None or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("source") != _source_stamp(vae):
            return None
        projection = LatentProjection.from_json(data)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return projection if projection.channels == channels and projection.patch == patch else None


def _store(vae: Any, cache_dir: Path | None, projection: LatentProjection) -> None:
    path = _cache_path(vae, cache_dir)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.with_name(path.name + ".part")
        staged.write_text(json.dumps({"model": str(vae.path), "source": _source_stamp(vae), **projection.to_json()}),
                          encoding="utf-8")
        staged.replace(path)
    except OSError as exc:  # an unwritable cache folder: the fit is kept in memory only
        logger.debug("preview projection of %s not cached in %s: %s", vae.path, cache_dir, exc)


def projection_for(vae: Any, cache_dir: Path | None = None, *,
                   announce: Callable[[], None] | None = None) -> LatentProjection:
    """The video VAE's preview projection: remembered, from metadata, cached in `cache_dir`, or fitted now
    (calling `announce` first, so the user hears why the first preview takes a while)."""
    cached = getattr(vae, "preview_projection", None)
    if cached is not None:
        return cached
    with _fit_lock:
        cached = getattr(vae, "preview_projection", None)
        if cached is not None:
            return cached
        config = vae.model.config
        channels, patch = int(config.latent_channels), int(config.spatial_ratio)
        identity = _file_identity(vae)
        projection = _fits_by_file.get(identity) if identity is not None else None
        projection = projection or _from_metadata(vae, channels, patch) or _from_disk(vae, cache_dir, channels, patch)
        if projection is None:
            if announce is not None:
                announce()
            projection = fit_projection(lambda z: vae.model.decode(z, tile_batch=1), channels, patch)
            _store(vae, cache_dir, projection)
        if identity is not None:
            _fits_by_file[identity] = projection
        vae.preview_projection = projection
        return projection


def register_vae(vae: Any) -> None:
    """Make a freshly loaded video VAE the preview source for its latents (its projection is fitted when
    the first preview is drawn)."""
    if getattr(vae, "kind", None) != "video":
        return
    ctx = current()
    channels = int(vae.model.config.latent_channels)
    ctx.runtime.shared(SOURCES_KEY, dict)[channels] = vae


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

    def __init__(self, ctx: RunContext, method: str, vae: Any = None, size: int = DEFAULT_PREVIEW_SIZE) -> None:
        self.ctx = ctx
        self.method = method
        self.vae = vae
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
        has_audio = isinstance(latent.get("audio_samples"), torch.Tensor)
        if vae is None and not has_audio:
            method = "none"  # nothing to draw: plain progress
        return cls(ctx, method, vae, ctx.runtime.preview_size)

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
            if self.vae is not None and isinstance(video, torch.Tensor) and video.dim() == 5:
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
                    picture = self._picture(frame, sound)
                except Exception:
                    self.failed = True
                    logger.warning("live previews stopped for node %s: rendering failed", self.ctx.node_id,
                                   exc_info=True)
            self.ctx.send_progress(step, total, preview=("JPEG", picture, self.size) if picture is not None else None)

    def _picture(self, frame: torch.Tensor | None, sound: torch.Tensor | None):
        from PIL import Image

        if frame is None:
            return audio_picture(sound, self.size)
        patch = int(self.vae.model.config.spatial_ratio)
        if self.method == "full":
            pixels = self.vae.model.decode(frame[None, :, None], tile_batch=1)[0, 0]
        else:
            projection = projection_for(self.vae, cache_folder(self.ctx.paths.user), announce=self._announce_fit)
            pixels = projection.to_pixels(frame) if self.method == "taesd-like" else projection.to_rgb(frame)
        array = (pixels.mul(255.0).add_(0.5).clamp_(0, 255)).to(torch.uint8).numpy()
        image = Image.fromarray(array)
        # Never larger than the real picture nor than --preview-size on its long side.
        full_w, full_h = frame.shape[2] * patch, frame.shape[1] * patch
        scale = min(self.size / max(full_w, full_h), 1.0)
        target = (max(1, round(full_w * scale)), max(1, round(full_h * scale)))
        if image.size != target:
            image = image.resize(target, Image.BILINEAR)
        return draw_audio_band(image, sound) if sound is not None else image

    def _announce_fit(self) -> None:
        self.ctx.show(text="preparing live previews: fitting the preview colours from the VAE "
                           "(once per VAE file; the sampler keeps running)")
        logger.info("%s: fitting the live-preview projection (once per VAE file)", getattr(self.vae, "name", "VAE"))
