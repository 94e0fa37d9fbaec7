"""Live-preview settings: the methods, their command-line flags and a job's override (torch-free).

Methods (`--preview-method`, ComfyUI's flag; a job's `extra_data.preview_method` overrides it, as the editor
sends it):
- none: no previews.
- auto (the default): latent2rgb.
- latent2rgb: each latent pixel through a linear latent-to-RGB projection fitted from the VAE itself.
- taesd-like: a linear patch decoder, also fitted from the VAE: each latent pixel becomes its whole pixel
  patch (16x16 for H3), so the preview has the picture's full resolution for the cost of one matrix product.
  The editor's `taesd` asks for this.
- full: a real VAE decode of the previewed frame every `FULL_DECODE_EVERY` steps (and at the last one).
"""
from __future__ import annotations

import argparse
from typing import Any

from execution.context import DEFAULT_PREVIEW_METHOD, DEFAULT_PREVIEW_SIZE, Services

PREVIEW_METHODS = ("none", "auto", "latent2rgb", "taesd-like", "full")
FULL_DECODE_EVERY = 4
# The editor's names for the methods ("default" means: the server's setting).
EDITOR_NAMES = {"taesd": "taesd-like", "default": None}


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """The live-preview flags (server and headless runner)."""
    group = parser.add_argument_group("live previews")
    group.add_argument("--preview-method", choices=PREVIEW_METHODS, default=None,
                       help="how samplers draw the picture while they run: none; auto (latent2rgb); latent2rgb (a "
                            "linear projection fitted from the VAE); taesd-like (a fitted linear patch decoder, full "
                            f"resolution); full (a VAE decode every {FULL_DECODE_EVERY} steps). Default: auto for "
                            "the server, none for `run` (a terminal shows no pictures)")
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
    """The method a job uses: its own `preview_method` when valid, else the runtime's (auto -> latent2rgb)."""
    method = runtime.preview_method
    requested = (extra_data or {}).get("preview_method")
    if isinstance(requested, str):
        requested = EDITOR_NAMES.get(requested, requested)
        if requested in PREVIEW_METHODS:
            method = requested
    return "latent2rgb" if method == "auto" else method
