"""The unified Linear: `residual + residual_scale * (prologue(x) @ weight.T + bias)`.

One public function, `linear`, with several backends behind a capability check. `eager` is the
reference and always works. (More backends are registered by the kernels issue.)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

PROLOGUES = (None, "rms_norm", "swiglu", "gelu_tanh")


def apply_prologue(x: torch.Tensor, prologue: str | None, prologue_weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    if prologue is None:
        return x
    if prologue == "rms_norm":
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        if prologue_weight is not None:
            normed = normed * prologue_weight.float()
        return normed.to(x.dtype)
    if prologue == "swiglu":
        gate, value = x.chunk(2, dim=-1)
        return F.silu(gate) * value
    if prologue == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    raise ValueError(f"unknown prologue {prologue!r}; expected one of {PROLOGUES}")


def linear_eager(x, weight, bias=None, *, prologue=None, prologue_weight=None, eps=1e-6,
                 residual=None, residual_scale=None):
    """The reference implementation."""
    y = F.linear(apply_prologue(x, prologue, prologue_weight, eps), weight, bias)
    if residual_scale is not None:
        y = y * residual_scale
    if residual is not None:
        y = residual + y
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           prologue: str | None = None, prologue_weight: torch.Tensor | None = None, eps: float = 1e-6,
           residual: torch.Tensor | None = None, residual_scale: torch.Tensor | float | None = None) -> torch.Tensor:
    """`residual + residual_scale * (prologue(x) @ weight.T + bias)` (see module docstring)."""
    return linear_eager(x, weight, bias, prologue=prologue, prologue_weight=prologue_weight, eps=eps,
                        residual=residual, residual_scale=residual_scale)
