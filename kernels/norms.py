"""Normalisations shared by the fused ops and the model modules (computed in float32, returned in the input dtype)."""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """`x / sqrt(mean(x^2, last dim) + eps) * weight`, accumulated in float32."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        normed = normed * weight.float()
    return normed.to(x.dtype)


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
