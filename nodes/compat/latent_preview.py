"""ComfyUI's `latent_preview` basics for plugins: a sampler callback that reports progress and live previews
the way Weft's own samplers do (nodes/previews.py).

Provided: prepare_callback(model, steps, x0_output_dict=None) returns callback(step, x0, x, total_steps),
which reports step + 1 of total_steps as the running node's progress (stopping an interrupted job there)
and hands x0, the denoised estimate (an H3 video latent (B, C, T, H, W), or a latent dict with `samples`
and `audio_samples`), to the job's preview method, drawn by the video VAE last loaded for that many latent
channels; x0 is kept in x0_output_dict["x0"] when a dict is given, and the last step waits until its
preview is sent. `model` is accepted for ComfyUI's signature: Weft finds the preview source by the
latent's channels. MAX_PREVIEW_RESOLUTION: the runtime's preview size (--preview-size).
get_previewer(device, latent_format) returns a LatentPreviewer drawing latent frames the way the job's
preview method does (with the video VAE last loaded for the latent_format's `latent_channels`, or the only
one loaded), or None when the job shows no previews or no VAE can draw them; LatentPreviewer is the base
class, whose decode_latent_to_preview_image(format, x0) gives (format, picture, MAX_PREVIEW_RESOLUTION).
Not provided: TAESD, set_preview_method (the method is chosen per job), latent formats.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from execution.context import current
from nodes.preview_settings import resolve_method
from nodes.previews import SOURCES_KEY, SamplerPreviews


def __getattr__(name: str) -> Any:
    if name == "MAX_PREVIEW_RESOLUTION":  # read live: the running runtime's setting
        return int(current().runtime.preview_size)
    raise AttributeError(f"module 'latent_preview' (Weft compatibility layer) has no attribute {name!r}; it provides "
                         "prepare_callback, get_previewer, LatentPreviewer and MAX_PREVIEW_RESOLUTION")


class LatentPreviewer:
    """Draws a denoised latent as a preview picture; subclasses give `decode_latent_to_preview`."""

    def decode_latent_to_preview(self, x0: Any) -> Any:
        raise NotImplementedError

    def decode_latent_to_preview_image(self, preview_format: str, x0: Any) -> tuple[str, Any, int]:
        """(format, Pillow picture, longest side allowed) as a preview event carries it."""
        return preview_format, self.decode_latent_to_preview(x0), int(current().runtime.preview_size)


class _JobPreviewer(LatentPreviewer):
    """The job's own preview drawing (nodes/previews.py) over one video VAE."""

    def __init__(self, previews: SamplerPreviews) -> None:
        self.previews = previews

    def decode_latent_to_preview(self, x0: Any) -> Any:
        if isinstance(x0, dict):
            x0 = x0.get("samples")
        if not isinstance(x0, torch.Tensor) or x0.dim() not in (4, 5):
            raise TypeError(f"latent_preview: expected a latent tensor (B, C, [T,] H, W), got {type(x0).__name__}")
        frame = x0[0, :, x0.shape[2] // 2] if x0.dim() == 5 else x0[0]  # (C, H, W): the middle frame
        return self.previews._picture(frame.detach().float().cpu())


def get_previewer(device: Any = None, latent_format: Any = None) -> LatentPreviewer | None:
    """A previewer for the running job (see the module docstring), or None when it shows no previews."""
    ctx = current()
    method = resolve_method(ctx.runtime, ctx.extra_data)
    sources = ctx.runtime.shared(SOURCES_KEY, dict)
    channels = getattr(latent_format, "latent_channels", None)
    vae = sources.get(channels) if channels is not None else (next(iter(sources.values())) if len(sources) == 1 else None)
    if method == "none" or vae is None:
        return None
    return _JobPreviewer(SamplerPreviews(ctx, method, vae, ctx.runtime.preview_size))


class SamplerCallback:
    """The callback prepare_callback returns: one sampler run's progress and previews."""

    def __init__(self, steps: int, x0_output_dict: dict | None) -> None:
        self.steps = steps
        self.x0_output_dict = x0_output_dict
        self.previews: SamplerPreviews | None = None

    def __call__(self, step: int, x0: Any, x: Any = None, total_steps: int | None = None) -> None:
        if self.x0_output_dict is not None:
            self.x0_output_dict["x0"] = x0
        denoised = x0 if isinstance(x0, dict) else {"samples": x0} if isinstance(x0, torch.Tensor) else {}
        if self.previews is None:  # on the first step, in the node's own context
            self.previews = SamplerPreviews.start(denoised)
        total = int(total_steps if total_steps is not None else self.steps)
        try:
            self.previews.report(step + 1, total, denoised)
        except BaseException:
            self.previews.close(wait=False)
            raise
        if step + 1 >= total:
            self.previews.close()


def prepare_callback(model: Any, steps: int, x0_output_dict: dict | None = None) -> Callable[..., None]:
    """A `callback(step, x0, x, total_steps)` for a sampler loop (see the module docstring)."""
    return SamplerCallback(int(steps), x0_output_dict)
