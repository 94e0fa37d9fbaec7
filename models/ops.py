"""Modules whose weights reach their op through the device-memory manager.

Model code builds layers from these instead of torch.nn so that weights can live off the device
and be taken per op (see models/memory.py): each forward takes its weights (cast to the input's
dtype, adapter patches applied), runs its op and releases them. Parameter names and constructor
arguments match torch.nn (`weight`, `bias`), so checkpoint keys load by name and
`load_state_dict` works unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.conv3d import causal_conv3d
from kernels.linear import linear
from kernels.norms import rms_norm
from models.memory import release, take, using


class Linear(nn.Linear):
    """nn.Linear whose forward is the unified fused Linear (prologue/epilogue optional).

    `prologue_weight` may be a tensor or a module whose `weight` is the prologue's (an RMSNorm):
    a module's weight is taken through the memory manager like this layer's own.
    """

    def forward(self, x: torch.Tensor, *, prologue: str | None = None,
                prologue_weight: torch.Tensor | nn.Module | None = None, eps: float = 1e-6,
                residual: torch.Tensor | None = None,
                residual_scale: torch.Tensor | float | None = None) -> torch.Tensor:
        norm_module = prologue_weight if isinstance(prologue_weight, nn.Module) else None
        if norm_module is not None:
            prologue_weight, _ = take(norm_module, dtype=x.dtype)
        try:
            with using(self, dtype=x.dtype) as (weight, bias):
                return linear(x, weight, bias, prologue=prologue, prologue_weight=prologue_weight, eps=eps,
                              residual=residual, residual_scale=residual_scale)
        finally:
            if norm_module is not None:
                release(norm_module)


class Conv1d(nn.Conv1d):
    """nn.Conv1d with weights taken per call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with using(self, dtype=x.dtype) as (weight, bias):
            return self._conv_forward(x, weight, bias)  # (B, C_out, L_out)


class ConvTranspose1d(nn.ConvTranspose1d):
    """nn.ConvTranspose1d with weights taken per call."""

    def forward(self, x: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        output_padding = self._output_padding(x, output_size, self.stride, self.padding, self.kernel_size, 1,
                                              self.dilation)
        with using(self, dtype=x.dtype) as (weight, bias):
            return F.conv_transpose1d(x, weight, bias, self.stride, self.padding, output_padding, self.groups,
                                      self.dilation)  # (B, C_out, L_out)


class Conv3d(nn.Conv3d):
    """nn.Conv3d with weights taken per call (padding as configured, like torch.nn)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with using(self, dtype=x.dtype) as (weight, bias):
            return self._conv_forward(x, weight, bias)  # (B, C_out, T', H', W')


class CausalConv3d(nn.Conv3d):
    """A causal video convolution: zeros before the first frame, reflect padding in space.

    Same parameters as nn.Conv3d (its `padding` argument is not accepted: the padding is implied by
    the kernel size). forward optionally fuses a per-frame GroupNorm + SiLU before the convolution
    and a residual add after it, through kernels/conv3d.causal_conv3d; `context` carries the last
    input frames of the previous temporal chunk so chunked encoding equals one pass.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | tuple[int, int, int],
                 stride: int | tuple[int, int, int] = 1, dilation: int | tuple[int, int, int] = 1,
                 bias: bool = True, spatial_padding: str = "reflect", device=None, dtype=None) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=0, dilation=dilation,
                         bias=bias, device=device, dtype=dtype)
        self.spatial_padding = spatial_padding

    def forward(self, x: torch.Tensor, *, norm: nn.GroupNorm | None = None, silu: bool = False,
                residual: torch.Tensor | None = None, context: torch.Tensor | None = None) -> torch.Tensor:
        norm_weight = norm_bias = None
        if norm is not None:
            norm_weight, norm_bias = take(norm, dtype=x.dtype)
        try:
            with using(self, dtype=x.dtype) as (weight, bias):
                return causal_conv3d(
                    x, weight, bias, stride=self.stride, dilation=self.dilation,
                    num_groups=norm.num_groups if norm is not None else None,
                    norm_weight=norm_weight, norm_bias=norm_bias, eps=norm.eps if norm is not None else 1e-6,
                    silu=silu, spatial_padding=self.spatial_padding, residual=residual,
                    context=context)  # (B, C_out, T', H', W')
        finally:
            if norm is not None:
                release(norm)


class GroupNorm(nn.GroupNorm):
    """nn.GroupNorm with weights taken per call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with using(self, dtype=x.dtype) as (weight, bias):
            return F.group_norm(x, self.num_groups, weight, bias, self.eps)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm with weights taken per call (no weight/bias when elementwise_affine=False)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with using(self, dtype=x.dtype) as (weight, bias):
            return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (parameter `weight`) computed in float32, with weights taken per call; eps defaults to 1e-6."""

    def __init__(self, normalized_shape: int | list[int] | torch.Size, eps: float = 1e-6,
                 elementwise_affine: bool = True, device=None, dtype=None) -> None:
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, device=device, dtype=dtype)
        if len(self.normalized_shape) != 1:
            raise ValueError(f"RMSNorm normalises the last dimension only; got normalized_shape {self.normalized_shape}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with using(self, dtype=x.dtype) as (weight, _bias):
            return rms_norm(x, weight, self.eps)


class Embedding(nn.Embedding):
    """nn.Embedding with weights taken per call; the output is in `dtype` (default: the weights' own)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.max_norm is not None:
            # max_norm renormalises the stored weight in place, which would write into the offload copy.
            raise ValueError("Embedding(max_norm=...) is not supported: it rewrites the weights in place")

    def forward(self, ids: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        with using(self, dtype=dtype) as (weight, _bias):
            return F.embedding(ids, weight, self.padding_idx)  # (*ids.shape, embedding_dim)
