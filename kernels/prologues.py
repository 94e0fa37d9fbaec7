"""The input transforms the unified Linear (kernels/linear.py) can fuse in front of its matrix product."""
from __future__ import annotations

from enum import StrEnum


class Prologue(StrEnum):
    """What the unified Linear applies to x before the product; each value is the name callers may pass."""

    RMS_NORM = "rms_norm"    # x / rms(x) * prologue_weight (eps inside the root)
    SWIGLU = "swiglu"        # silu(first half of x) * second half: x has twice the weight's input features
    GELU_TANH = "gelu_tanh"  # GELU with the tanh approximation

    @classmethod
    def parse(cls, value: Prologue | str | None) -> Prologue | None:
        """`value` as a Prologue (None stays None); ValueError listing the choices for anything else."""
        if value is None or isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(repr(p.value) for p in cls)
            raise ValueError(f"unknown prologue {value!r}; expected None or one of {choices}") from None
