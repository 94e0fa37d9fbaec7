"""Fused causal Conv3d: per-frame GroupNorm, SiLU, causal temporal padding, reflect spatial padding, conv, residual.

One public function, `causal_conv3d`, with the backend scheme of kernels/registry.py:
  eager     the reference (`causal_conv3d_eager`), one torch op per step
  compiled  the same function through torch.compile, once per shape class (frame count dynamic), so the
            norm, activation and padding become one pass feeding the convolution

Causality: output frame t sees input frames <= t only; the front is padded with
`dilation_t * (kernel_t - 1)` zero frames, or with the last frames of `context` (the previous chunk's
input) so a video encoded chunk by chunk equals one pass. GroupNorm statistics are per frame, which is
what makes that exact. Zero padding is applied after the norm and the activation, as the
convolution's own padding would be.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import compiled as _compiled
from kernels.norms import group_norm_per_frame
from kernels.registry import KernelRegistry

SPATIAL_PADDINGS = ("reflect", "replicate", "zeros")
HALF_DTYPES = (torch.float16, torch.bfloat16)


def _triple(value: int | tuple[int, ...], name: str) -> tuple[int, int, int]:
    if isinstance(value, int):
        return (value, value, value)
    value = tuple(int(v) for v in value)
    if len(value) != 3:
        raise ValueError(f"causal_conv3d: {name} must be an int or 3 ints, got {value}")
    return value


def _front_frames(weight: torch.Tensor, dilation: tuple[int, int, int]) -> int:
    return dilation[0] * (weight.shape[2] - 1)


def causal_conv3d_eager(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                        stride: int | tuple[int, int, int] = 1, dilation: int | tuple[int, int, int] = 1,
                        num_groups: int | None = None, norm_weight: torch.Tensor | None = None,
                        norm_bias: torch.Tensor | None = None, eps: float = 1e-6, silu: bool = False,
                        spatial_padding: str = "reflect", residual: torch.Tensor | None = None,
                        context: torch.Tensor | None = None) -> torch.Tensor:
    """The reference implementation, step by step."""
    stride, dilation = _triple(stride, "stride"), _triple(dilation, "dilation")
    front = _front_frames(weight, dilation)
    h = x  # (B, C_in, T, H, W)
    context_frames = 0
    if context is not None and front > 0:
        context = context[:, :, -front:]
        context_frames = context.shape[2]
        h = torch.cat([context, h], dim=2)  # (B, C_in, ctx + T, H, W)
    if num_groups is not None:
        h = group_norm_per_frame(h, num_groups, norm_weight, norm_bias, eps)
    if silu:
        h = F.silu(h)
    pad_h = dilation[1] * (weight.shape[3] - 1)
    pad_w = dilation[2] * (weight.shape[4] - 1)
    spatial = (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2)
    if any(spatial) and spatial_padding != "zeros":
        # reflect/replicate pad the last three dims of a 5-D tensor; time gets 0 here.
        h = F.pad(h, (*spatial, 0, 0), mode=spatial_padding)
        spatial = (0, 0, 0, 0)
    if h.shape[2] == 1 and context_frames == 0:
        # One frame behind zero padding: only the kernel's last temporal tap meets data, so this is a 2-D
        # convolution (3-4x faster on a CPU for one picture; the zero taps would add exact zeros).
        h = F.pad(h, spatial)
        out = F.conv2d(h[:, :, 0], weight[:, :, -1], bias, stride=stride[1:], dilation=dilation[1:]).unsqueeze(2)
    else:
        h = F.pad(h, (*spatial, front - context_frames, 0))  # zeros: causal front (+ spatial if "zeros")
        out = F.conv3d(h, weight, bias, stride=stride, dilation=dilation)  # (B, C_out, T', H', W')
    if residual is not None:
        out = out + residual
    return out


def check_arguments(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_groups: int | None,
                    norm_weight: torch.Tensor | None, norm_bias: torch.Tensor | None, spatial_padding: str,
                    residual: torch.Tensor | None, context: torch.Tensor | None,
                    stride: tuple[int, int, int], dilation: tuple[int, int, int]) -> None:
    """Raise ValueError naming the shapes when the arguments do not describe one causal conv."""
    if x.dim() != 5 or weight.dim() != 5:
        raise ValueError(f"causal_conv3d: x must be (B, C, T, H, W) and weight (C_out, C_in, kT, kH, kW); "
                         f"got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"causal_conv3d: x has {x.shape[1]} channels, weight expects {weight.shape[1]} "
                         f"(x {tuple(x.shape)}, weight {tuple(weight.shape)})")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"causal_conv3d: bias must be ({weight.shape[0]},), got {tuple(bias.shape)}")
    if spatial_padding not in SPATIAL_PADDINGS:
        raise ValueError(f"causal_conv3d: spatial_padding {spatial_padding!r} is not one of {SPATIAL_PADDINGS}")
    if num_groups is not None:
        if x.shape[1] % num_groups:
            raise ValueError(f"causal_conv3d: {x.shape[1]} channels do not split into {num_groups} groups")
        for name, tensor in (("norm_weight", norm_weight), ("norm_bias", norm_bias)):
            if tensor is not None and tuple(tensor.shape) != (x.shape[1],):
                raise ValueError(f"causal_conv3d: {name} must be ({x.shape[1]},), got {tuple(tensor.shape)}")
    elif norm_weight is not None or norm_bias is not None:
        raise ValueError("causal_conv3d: norm_weight/norm_bias given without num_groups")
    if spatial_padding == "reflect":
        for axis, size in ((3, x.shape[3]), (4, x.shape[4])):
            pad = dilation[axis - 2] * (weight.shape[axis] - 1)
            if pad - pad // 2 >= size:
                raise ValueError(f"causal_conv3d: reflect padding {pad - pad // 2} needs more than {size} pixels "
                                 f"(x {tuple(x.shape)}, weight {tuple(weight.shape)})")
    if context is not None and (context.dim() != 5 or context.shape[:2] != x.shape[:2] or context.shape[3:] != x.shape[3:]):
        raise ValueError(f"causal_conv3d: context {tuple(context.shape)} must match x {tuple(x.shape)} except in frames")
    if residual is not None:
        frames = (x.shape[2] - 1) // stride[0] + 1
        height = (x.shape[3] - 1) // stride[1] + 1
        width = (x.shape[4] - 1) // stride[2] + 1
        expected = (x.shape[0], weight.shape[0], frames, height, width)
        if tuple(residual.shape) != expected:
            raise ValueError(f"causal_conv3d: residual must have the output's shape {expected}, got {tuple(residual.shape)}")


# ----------------------------------------------------------------------------------------------
# compiled backend

_conv_compiler = _compiled.ShapeClassCompiler(causal_conv3d_eager)


def _compiled_check(x, weight, bias=None, *, stride=1, dilation=1, num_groups=None, norm_weight=None,
                    norm_bias=None, eps=1e-6, silu=False, spatial_padding="reflect", residual=None,
                    context=None) -> str | None:
    tensors = [x, weight, bias, norm_weight, norm_bias, residual, context]
    if any(t is not None and t.device != x.device for t in tensors):
        return "inputs are on different devices"
    return _compiled.decline_reason(tensors)


# Compiling one convolution's shape class costs 2.5-7.5 s of CPU and then saves 3-20% of its time (measured
# on an AVX2 CPU: 2^29 multiply-adds 60.5 -> 56.8 ms, 2^32 147 -> 117 ms, 2^35 685 -> 563 ms). Only calls
# this large, of which a real video decode makes hundreds per shape class, repay it; a small VAE (the tiny
# models, one picture) stays eager.
MIN_COMPILE_MACS = 1 << 34


def _compiled_worthwhile(x, weight, bias=None, *, stride=1, **_options) -> str | None:
    stride = _triple(stride, "stride")
    outputs = x.shape[0] * ((x.shape[2] - 1) // stride[0] + 1) * ((x.shape[3] - 1) // stride[1] + 1) \
        * ((x.shape[4] - 1) // stride[2] + 1)
    return _compiled.worthwhile(outputs * weight[0].numel() * weight.shape[0], MIN_COMPILE_MACS)


def causal_conv3d_compiled(x, weight, bias=None, *, stride=1, dilation=1, num_groups=None, norm_weight=None,
                           norm_bias=None, eps=1e-6, silu=False, spatial_padding="reflect", residual=None,
                           context=None):
    """causal_conv3d_eager through torch.compile, once per shape class (frame count dynamic)."""
    stride, dilation = _triple(stride, "stride"), _triple(dilation, "dilation")
    front = _front_frames(weight, dilation)
    context_frames = min(front, context.shape[2]) if context is not None and front > 0 else 0
    key = (tuple(x.shape[:2]), tuple(x.shape[3:]), tuple(weight.shape), x.dtype, x.device.type, stride, dilation,
           bias is not None, num_groups, norm_weight is not None, norm_bias is not None, float(eps), bool(silu),
           spatial_padding, residual is not None, context_frames, x.shape[2] == 1)
    dynamic = [(x, 2)] + ([(residual, 2)] if residual is not None else [])
    return _conv_compiler.run(key, x, weight, bias, stride=stride, dilation=dilation, num_groups=num_groups,
                              norm_weight=norm_weight, norm_bias=norm_bias, eps=float(eps), silu=bool(silu),
                              spatial_padding=spatial_padding, residual=residual,
                              context=context[:, :, -front:] if context_frames else None,
                              dynamic=dynamic if x.shape[2] > 1 else [])


CONV3D = KernelRegistry("conv3d")
CONV3D.register("eager", causal_conv3d_eager)
CONV3D.register("compiled", causal_conv3d_compiled, check=_compiled_check, available=_compiled.available,
                worthwhile=_compiled_worthwhile, before="eager")


def causal_conv3d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  stride: int | tuple[int, int, int] = 1, dilation: int | tuple[int, int, int] = 1,
                  num_groups: int | None = None, norm_weight: torch.Tensor | None = None,
                  norm_bias: torch.Tensor | None = None, eps: float = 1e-6, silu: bool = False,
                  spatial_padding: str = "reflect", residual: torch.Tensor | None = None,
                  context: torch.Tensor | None = None) -> torch.Tensor:
    """`residual + conv3d(causal_pad(silu(group_norm_per_frame(x))))`: x (B, C_in, T, H, W) -> (B, C_out, T', H', W')."""
    stride_t, dilation_t = _triple(stride, "stride"), _triple(dilation, "dilation")
    check_arguments(x, weight, bias, num_groups, norm_weight, norm_bias, spatial_padding, residual, context,
                    stride_t, dilation_t)
    stored = x.dtype
    if x.device.type == "cpu" and stored in HALF_DTYPES:
        # CPU convolutions in float16/bfloat16 have no fast kernel (about 10x slower than float32 at a VAE's
        # shapes on an AVX2 CPU): compute in float32 and round the result once to the stored dtype.
        x, weight, bias, norm_weight, norm_bias, residual, context = (
            None if t is None else t.float() for t in (x, weight, bias, norm_weight, norm_bias, residual, context))
    out = CONV3D(x, weight, bias, stride=stride_t, dilation=dilation_t, num_groups=num_groups,
                 norm_weight=norm_weight, norm_bias=norm_bias, eps=eps, silu=silu,
                 spatial_padding=spatial_padding, residual=residual, context=context)
    return out.to(stored)
