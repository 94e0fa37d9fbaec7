"""Kernel option names the command line offers; torch-free so `main.py --help` never imports torch."""

# The `--fast` options: faster, less exact math a user opts into.
FAST_OPTIONS = ("fp16_accumulation",)
