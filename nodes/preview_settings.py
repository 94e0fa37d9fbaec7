"""Live-preview settings: the methods, their command-line flags and a job's override (torch-free).

Who gets previews: a job that asks for a method (`extra_data.preview_method`, as the editor sends its "Live
preview method" setting) gets that one; otherwise the server's `--preview-method` when it was started with
one; otherwise, as in ComfyUI, none, so an API client that never asked receives no preview frames. The one
exception is a job from the editor itself (`extra_data.comfy_usage_source` is the frontend's) whose
setting is left at "default": it gets `auto`, so the editor shows previews out of the box.

Methods (`--preview-method`, ComfyUI's flag):
- none: no previews.
- auto: latent2rgb.
- latent2rgb: each latent pixel through a linear latent-to-RGB projection fitted from the VAE itself.
- taesd: the taeh3 tiny decoder (`models/vae_approx/taeh3.safetensors`, models/h3/taeh3.py) decodes the
  previewed latent frame, from the start of its clip, to a full-resolution frame; without that file,
  latent2rgb (said once in the log). The editor's "TAESD" setting asks for this.
- taesd-like: a linear patch decoder, also fitted from the VAE: each latent pixel becomes its whole pixel
  patch (16x16 for H3), so the preview has the picture's full resolution for the cost of one matrix product.
- full: a real VAE decode of the previewed frame every `FULL_DECODE_EVERY` steps (and at the last one).
"""
from __future__ import annotations

import argparse
from typing import Any

from execution.context import DEFAULT_PREVIEW_METHOD, DEFAULT_PREVIEW_SIZE, Services

PREVIEW_METHODS = ("none", "auto", "latent2rgb", "taesd", "taesd-like", "full")
FULL_DECODE_EVERY = 4
# The editor's names for the methods ("default" means: the server's setting).
EDITOR_NAMES = {"default": None}
EDITOR_SOURCE = "comfyui-frontend"  # provenance: interface (the editor's extra_data.comfy_usage_source)
EDITOR_DEFAULT_METHOD = "auto"  # an editor job with its setting at "default", on a server started without one


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """The live-preview flags (server and headless runner)."""
    group = parser.add_argument_group("live previews")
    group.add_argument("--preview-method", choices=PREVIEW_METHODS, default=None,
                       help="how samplers draw the picture while they run: none; auto (latent2rgb); latent2rgb (a "
                            "linear projection fitted from the VAE); taesd (the taeh3 tiny decoder from "
                            "models/vae_approx/taeh3.safetensors, else latent2rgb); taesd-like (a fitted linear "
                            "patch decoder, full "
                            f"resolution); full (a VAE decode every {FULL_DECODE_EVERY} steps). Without it a job "
                            "gets previews only when it asks for them (the editor asks, API clients usually "
                            "do not); `run` draws none (a terminal shows no pictures)")
    group.add_argument("--preview-size", type=_preview_size, default=DEFAULT_PREVIEW_SIZE, metavar="PIXELS",
                       help=f"longest side of a preview image (default {DEFAULT_PREVIEW_SIZE})")


def _preview_size(text: str) -> int:
    try:
        size = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of pixels, got {text!r}") from None
    if size < 8:
        raise argparse.ArgumentTypeError(f"must be at least 8 pixels, got {size}")
    return size


def services_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The runtime services entries the preview flags set (defaults when the parser had no preview flags)."""
    return {"preview_method": getattr(args, "preview_method", None) or DEFAULT_PREVIEW_METHOD,
            "preview_size": int(getattr(args, "preview_size", DEFAULT_PREVIEW_SIZE))}


def resolve_method(runtime: Services, extra_data: dict[str, Any] | None) -> str:
    """The method a job uses: its own `preview_method` when valid; else the server's flag; else none
    (auto for the editor's own jobs). `auto` means latent2rgb."""
    extra = extra_data or {}
    requested = extra.get("preview_method")
    method = None
    if isinstance(requested, str):
        method = EDITOR_NAMES.get(requested, requested)
        if method not in PREVIEW_METHODS:
            method = None
    if method is None:
        method = runtime.preview_method
    if method is None:
        method = EDITOR_DEFAULT_METHOD if extra.get("comfy_usage_source") == EDITOR_SOURCE else "none"
    return "latent2rgb" if method == "auto" else method
