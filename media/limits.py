"""How much one media file may decode to: the caps every video and sound decoder checks.

A small file can describe a huge amount of picture or sound (600 black frames in 20 KB, thirty
minutes of silence in 300 KB), so each decoder checks what the file declares against these caps before
it decodes anything, and counts what it has decoded as it goes (a header can lie or say nothing).
Still images have their own pixel caps in `media.image`.

The caps are part of the configured runtime, set once from the command line (`--max-decode-mb`,
`--max-media-seconds`); this module is torch-free so `main.py --help` stays fast.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

FLOAT_BYTES = 4  # decoded pictures and sound are held as float32 tensors
PICTURE_CHANNELS = 3


@dataclass(frozen=True)
class DecodeLimits:
    """The caps on decoding one file (its pictures, and separately its sound)."""

    # Bytes of the float32 tensor one file's pictures, or its sound, decode into. 2 GiB holds 121 frames
    # of 1920x1080, or about 3 hours of 48 kHz stereo sound.
    max_decoded_bytes: int = 2 * 2**30
    # Seconds of picture or sound a file may declare; longer files are refused when opened.
    max_seconds: float = 600.0
    # Pixels of one video frame (as for still images: 64 MP, e.g. 8000x8000).
    max_frame_pixels: int = 64_000_000
    # Sample rates outside this range are refused: below it, converting to a model's rate multiplies the
    # sample count by thousands; above it no real recording exists.
    min_sample_rate_hz: int = 1000
    max_sample_rate_hz: int = 768_000

    def check_sample_rate(self, rate_hz: int, what: str) -> None:
        """A ValueError naming `what` when `rate_hz` is outside the accepted range."""
        if not self.min_sample_rate_hz <= rate_hz <= self.max_sample_rate_hz:
            raise ValueError(f"{what} has a sample rate of {rate_hz} Hz; sample rates from "
                             f"{self.min_sample_rate_hz} to {self.max_sample_rate_hz} Hz are accepted")

    def check_seconds(self, seconds: float | None, what: str) -> None:
        """A ValueError when a declared duration passes the cap (None: not declared, nothing to check)."""
        if seconds is not None and seconds > self.max_seconds:
            raise ValueError(f"{what} lasts {seconds:.1f} s, over the limit of {self.max_seconds:g} s "
                             f"(--max-media-seconds)")

    def check_bytes(self, decoded_bytes: int, what: str) -> None:
        """A ValueError when `decoded_bytes` (declared, or counted so far) passes the cap."""
        if decoded_bytes > self.max_decoded_bytes:
            raise ValueError(f"{what} decodes to more than {self.max_decoded_bytes // 2**20} MB, the limit "
                             f"(--max-decode-mb)")


_configured = DecodeLimits()


def decode_limits() -> DecodeLimits:
    """The caps this runtime decodes under."""
    return _configured


def configure(limits: DecodeLimits) -> None:
    """Set the runtime's caps (once, where the runtime is wired; tests set their own)."""
    global _configured
    _configured = limits


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the decoding caps' flags to `parser` (main.py's server and run commands)."""
    group = parser.add_argument_group("media decoding caps")
    defaults = DecodeLimits()
    group.add_argument("--max-decode-mb", type=float, default=defaults.max_decoded_bytes / 2**20, metavar="MB",
                       help="Most MB one video's pictures, or one file's sound, may decode to "
                            f"(default {defaults.max_decoded_bytes // 2**20}).")
    group.add_argument("--max-media-seconds", type=float, default=defaults.max_seconds, metavar="S",
                       help=f"Longest video or sound file decoded, in seconds (default {defaults.max_seconds:g}).")


def configure_from_args(args: argparse.Namespace) -> None:
    """Set the caps the parsed flags ask for (defaults where the flags were not added)."""
    defaults = DecodeLimits()
    megabytes = getattr(args, "max_decode_mb", None)
    seconds = getattr(args, "max_media_seconds", None)
    if megabytes is not None and megabytes <= 0:
        raise SystemExit("--max-decode-mb must be positive")
    if seconds is not None and seconds <= 0:
        raise SystemExit("--max-media-seconds must be positive")
    configure(DecodeLimits(
        max_decoded_bytes=int(megabytes * 2**20) if megabytes is not None else defaults.max_decoded_bytes,
        max_seconds=float(seconds) if seconds is not None else defaults.max_seconds))
