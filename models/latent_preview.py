"""The latent-to-pixel projection a video VAE's live previews are drawn with, fitted from the VAE and cached.

The fit is made the first time a preview is drawn (never while a VAE loads, never when nobody asked
for previews): a few seeded random latents are decoded and a least-squares fit maps each latent pixel (its channels and
a bias) to the pixel patch it decodes to (`LatentProjection.to_pixels`, the `taesd-like` preview); its
mean over the patch is the colour of the latent pixel (`to_rgb`, the `latent2rgb` preview).

A fit is derived data of one model file, so it is kept where model-derived data is kept, never in a node:
on the VAE object, in this process by the file's identity (device, inode, size, mtime: a hit is the fit
of those very bytes, shared by every runtime and every hard link), and in Weft's own cache folder
(`<user>/weft-cache/preview-projections/`, one JSON file per model file named by a hash of its path,
holding the file's size and mtime and refitted when they change; nothing is ever written into a models
folder). A
model may also carry its own projection in its safetensors metadata (`weft_latent_rgb`: `{"weights":
[[r, g, b] per channel], "bias": [r, g, b]}`).

Previews are drawn on a helper thread beside a sampler that already keeps every core busy with torch's
OpenMP team; `one_cpu_thread_here` keeps the helper's own CPU ops to one thread, so it takes one core for
the time it draws instead of starting a second team that fights the sampler's for every core. When its
pictures need a good part of a core, the sampler's thread shrinks its own team by one with
`cpu_threads_here` (nodes/previews.py decides when).
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)

CACHE_FOLDER = ("weft-cache", "preview-projections")  # under the user folder: Weft's own, never a models folder
METADATA_KEY = "weft_latent_rgb"
FIT_BATCH = 1  # random latents decoded for a fit: one decoder window of 12 x 12 latent pixels gives
FIT_SIZE = 12  # 144 samples for the 25 unknowns per output of an H3 VAE (192 x 192 pixels, one tile)
FIT_SEED = 0

_fit_lock = threading.Lock()
_count_lock = threading.Lock()
# Fits by model file identity (device, inode, size, mtime): every runtime of the process, and every
# hard link of one file, shares one fit.
_fits_by_file: dict[tuple[int, int, int, int], "LatentProjection"] = {}


def one_cpu_thread_here() -> bool:
    """Run torch's CPU ops on the calling thread with one thread; other threads keep their count. True when
    that took effect (torch built with OpenMP, whose thread count is per calling thread).

    Without MKL's count (see `cpu_threads_here`), a process whose count was set explicitly (a Ray worker's)
    gave the render thread a second MKL team: four busy threads on two cores, which slowed a loop of small
    matrix products beside it about sevenfold in a measurement (1.3x with this thread's counts at 1)."""
    return cpu_threads_here(1) and torch.get_num_threads() == 1


def cpu_threads_here(count: int) -> bool:
    """Set the calling thread's torch CPU thread counts to `count`, leaving every other thread's, and the
    count threads started later begin with, as they were. False where counts are not kept per thread and
    nothing was changed.

    Two counts are per thread: OpenMP's, and MKL's own, which the matrix products inside convolutions and
    linears read. Only `torch.set_num_threads` reaches MKL's (its symbols are not exported), but it also
    stores the count every thread started later begins with; so that stored count is read first and put
    back afterwards, each from a short-lived thread (a new thread starts with it). Other parallel backends
    keep one count for the whole process (and refuse to change it once work has run): nothing is changed
    there."""
    if not _counts_are_per_thread():
        return False
    with _count_lock:  # two callers at once would each read the stored count the other just changed
        torch.get_num_threads()  # torch sets this thread's counts on its first query; let it happen now
        stored = _in_new_thread(torch.get_num_threads)
        torch.set_num_threads(count)
        if stored != count:
            _in_new_thread(lambda: torch.set_num_threads(stored))
    return True


def _in_new_thread(work: Callable[[], Any]) -> Any:
    """What `work` returns when run on a thread of its own (which starts with the stored thread counts)."""
    result = []
    thread = threading.Thread(target=lambda: result.append(work()), name="weft-thread-count")
    thread.start()
    thread.join()
    return result[0]


@functools.cache
def _counts_are_per_thread() -> bool:
    """True when torch's CPU thread counts are kept per calling thread (its OpenMP build)."""
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


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
