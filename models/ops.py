"""Modules whose weights reach their op through the device-memory manager.

Model code builds layers from these instead of torch.nn so that weights can live off the device
and be taken per op (see models/memory.py). Parameter names match torch.nn (`weight`, `bias`), so
checkpoint keys load by name.
"""
from __future__ import annotations

import torch
from torch import nn

from kernels.linear import linear


class Linear(nn.Linear):
    """nn.Linear whose forward is the unified fused Linear (prologue/epilogue optional)."""

    def forward(self, x: torch.Tensor, *, prologue: str | None = None, prologue_weight: torch.Tensor | None = None,
                eps: float = 1e-6, residual: torch.Tensor | None = None,
                residual_scale: torch.Tensor | float | None = None) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if weight.dtype != x.dtype:
            weight = weight.to(x.dtype)
            bias = bias.to(x.dtype) if bias is not None else None
        return linear(x, weight, bias, prologue=prologue, prologue_weight=prologue_weight, eps=eps,
                      residual=residual, residual_scale=residual_scale)
