"""The device-memory and kernel flags of the command line, torch-free so `main.py --help` stays fast.

`models.memory.configure_from_args` reads what these flags parse to.
"""
from __future__ import annotations

import argparse

from kernels.options import FAST_OPTIONS


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the device-memory and kernel flags to `parser` (main.py's server and run commands)."""
    group = parser.add_argument_group("device memory and kernels")
    group.add_argument("--vram-budget", type=float, default=None, metavar="GB",
                       help="Most GB of model weights kept on the device (default: free device memory minus --reserve-vram).")
    group.add_argument("--reserve-vram", type=float, default=None, metavar="GB",
                       help="GB of device memory left free for other programs and activations.")
    modes = group.add_mutually_exclusive_group()
    modes.add_argument("--highvram", action="store_true", help="Keep all weights on the device once loaded.")
    modes.add_argument("--lowvram", action="store_true",
                       help="Stream weights block by block: only the running and the next block stay on the device.")
    modes.add_argument("--novram", action="store_true", help="Stream weights op by op: nothing stays on the device between ops.")
    group.add_argument("--disable-fused-kernels", action="store_true",
                       help="Run every kernel through its eager reference backend.")
    group.add_argument("--fast", nargs="*", default=None, choices=FAST_OPTIONS, metavar="OPTION",
                       help=f"Opt into faster, less exact math; no OPTION turns on all of: {', '.join(FAST_OPTIONS)}.")
