"""Normalisations and the elementwise work fused with them (computed in float32, returned in the input dtype).

Two ops run between the H3 transformer's matrix products, each one public function with two backends
behind a capability check (kernels/registry.py):
  modulated_rms_norm  rms_norm(x) * (1 + scale[row]) + shift[row]: a pre-norm with AdaLN modulation
                      whose shift and scale rows are picked per token by `row_index`
  rms_norm_rope       rms_norm of every head, then split-half rotary positions (`rope_split_half`)
Backends: `eager` (the reference: the unfused ops, each rounding to the input's dtype as it goes) and
`compiled` (torch.compile of the whole expression: one pass over x, the per-token rows gathered
inside the loop, float32 throughout and one rounding at the end, so a bfloat16 result is within one
bfloat16 rounding of the reference and a float32 one within float32 rounding). Each unfused op
reads and writes the whole activation; fused, the norm, the gather and the modulation or the
rotation cost one read and one write.
"""
from __future__ import annotations

import torch

from kernels import compiled as _compiled
from kernels.registry import KernelRegistry

# Below this many elements a fused pass saves less than a compiled call's fixed cost; tiny models
# (the tests') stay eager and never compile.
MIN_FUSED_ELEMENTS = 1 << 18


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """`x / sqrt(mean(x^2, last dim) + eps) * weight`, accumulated in float32."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        normed = normed * weight.float()
    return normed.to(x.dtype)


def rope_split_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first 2 * cos.shape[-1] dims of each head, pairing dim i with dim i + half; the rest pass through.

    x: (..., S, H, D); cos/sin: (S, half) broadcast over heads.
    """
    half = cos.shape[-1]
    rot = 2 * half
    x1, x2, rest = x[..., :half], x[..., half:rot], x[..., rot:]
    c = cos.unsqueeze(-2).to(x.dtype)  # (S, 1, half)
    s = sin.unsqueeze(-2).to(x.dtype)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)


# ----------------------------------------------------------------------------------------------
# modulated_rms_norm

def modulated_rms_norm_eager(x: torch.Tensor, weight: torch.Tensor | None, eps: float, shift: torch.Tensor,
                             scale: torch.Tensor, row_index: torch.Tensor) -> torch.Tensor:
    """The reference: the norm rounded to x's dtype, then the gathered rows' affine in that dtype."""
    normed = rms_norm(x, weight, eps)  # (S, width)
    return normed * (1.0 + scale[row_index].to(x.dtype)) + shift[row_index].to(x.dtype)


def _modulated_graph(x: torch.Tensor, weight: torch.Tensor | None, eps: float, shift: torch.Tensor,
                     scale: torch.Tensor, row_index: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        normed = normed * weight.float()
    # Indexing inside the graph: inductor loads each token's row in the loop, never a (S, width) copy.
    return (normed * (1.0 + scale.float()[row_index]) + shift.float()[row_index]).to(x.dtype)


_modulated_compiler = _compiled.ShapeClassCompiler(_modulated_graph)


def _modulated_compiled(x, weight, eps, shift, scale, row_index):
    key = (x.dtype, x.device.type, x.shape[-1], weight is not None, shift.dtype, float(eps))
    return _modulated_compiler.run(key, x, weight, float(eps), shift, scale, row_index)


def _modulated_check(x, weight, eps, shift, scale, row_index) -> str | None:
    if x.dim() != 2:
        return f"x must be (tokens, width), got shape {tuple(x.shape)}"
    tensors = [x, weight, shift, scale]
    if any(t is not None and t.device != x.device for t in tensors + [row_index]):
        return "inputs are on different devices"
    return _compiled.decline_reason(tensors)


def _fused_worthwhile(x, *_args) -> str | None:
    if x.numel() < MIN_FUSED_ELEMENTS:
        return f"too small to repay a compiled call ({x.numel()} elements < {MIN_FUSED_ELEMENTS})"
    return None


MODULATED_RMS_NORM = KernelRegistry("modulated_rms_norm")
MODULATED_RMS_NORM.register("eager", modulated_rms_norm_eager)
MODULATED_RMS_NORM.register("compiled", _modulated_compiled, check=_modulated_check, available=_compiled.available,
                            worthwhile=_fused_worthwhile, before="eager")


def modulated_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, shift: torch.Tensor,
                       scale: torch.Tensor, row_index: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """rms_norm(x, weight, eps) * (1 + scale[row_index]) + shift[row_index]: x (S, width), tables (R, width), index (S,)."""
    if x.dim() != 2 or shift.shape != scale.shape or shift.shape[-1] != x.shape[-1] or row_index.shape != x.shape[:1]:
        raise ValueError(f"modulated_rms_norm: x {tuple(x.shape)}, shift {tuple(shift.shape)}, scale "
                         f"{tuple(scale.shape)} and row_index {tuple(row_index.shape)} do not fit together")
    return MODULATED_RMS_NORM(x, weight, eps, shift, scale, row_index, backend=backend)


# ----------------------------------------------------------------------------------------------
# rms_norm_rope

def rms_norm_rope_eager(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                        sin: torch.Tensor) -> torch.Tensor:
    """The reference: the per-head norm rounded to x's dtype, then the rotation in that dtype."""
    return rope_split_half(rms_norm(x, weight, eps), cos, sin)


def _rope_graph(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        normed = normed * weight.float()
    return rope_split_half(normed, cos.float(), sin.float()).to(x.dtype)


_rope_compiler = _compiled.ShapeClassCompiler(_rope_graph)


def _rope_compiled(x, weight, eps, cos, sin):
    key = (x.dtype, x.device.type, tuple(x.shape[1:]), weight is not None, cos.shape[-1], float(eps))
    return _rope_compiler.run(key, x, weight, float(eps), cos, sin)


def _rope_check(x, weight, eps, cos, sin) -> str | None:
    if x.dim() != 3:
        return f"x must be (tokens, heads, head_dim), got shape {tuple(x.shape)}"
    if any(t is not None and t.device != x.device for t in (weight, cos, sin)):
        return "inputs are on different devices"
    return _compiled.decline_reason([x, weight, cos, sin])


RMS_NORM_ROPE = KernelRegistry("rms_norm_rope")
RMS_NORM_ROPE.register("eager", rms_norm_rope_eager)
RMS_NORM_ROPE.register("compiled", _rope_compiled, check=_rope_check, available=_compiled.available,
                       worthwhile=_fused_worthwhile, before="eager")


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                  *, backend: str | None = None) -> torch.Tensor:
    """rope_split_half(rms_norm(x, weight, eps), cos, sin): x (S, heads, head_dim), cos/sin (S, half)."""
    if cos.shape != sin.shape or cos.shape[0] != x.shape[-3] or 2 * cos.shape[-1] > x.shape[-1]:
        raise ValueError(f"rms_norm_rope: x {tuple(x.shape)} does not fit cos {tuple(cos.shape)} / sin "
                         f"{tuple(sin.shape)} (S, half) with 2 * half <= head_dim")
    return RMS_NORM_ROPE(x, weight, eps, cos, sin, backend=backend)


def group_norm_per_frame(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None = None,
                         bias: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """GroupNorm of a video `(B, C, T, H, W)` with statistics per frame (over C/groups x H x W), float32 stats."""
    if x.dim() != 5:
        raise ValueError(f"group_norm_per_frame expects (B, C, T, H, W), got shape {tuple(x.shape)}")
    batch, channels, frames, height, width = x.shape
    if channels % num_groups:
        raise ValueError(f"group_norm_per_frame: {channels} channels do not split into {num_groups} groups")
    # Per-frame statistics make each frame independent of the others, which is what lets a causal
    # video VAE run chunk by chunk and get the same result as one pass.
    xf = x.float().view(batch, num_groups, channels // num_groups, frames, height * width)
    mean = xf.mean(dim=(2, 4), keepdim=True)
    var = xf.var(dim=(2, 4), keepdim=True, unbiased=False)
    normed = ((xf - mean) * torch.rsqrt(var + eps)).view(batch, channels, frames, height, width)
    if weight is not None:
        normed = normed * weight.float().view(1, channels, 1, 1, 1)
    if bias is not None:
        normed = normed + bias.float().view(1, channels, 1, 1, 1)
    return normed.to(x.dtype)
