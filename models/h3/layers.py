"""Building blocks shared by the H3 models: attention, split-half RoPE, RMSNorm, per-frame GroupNorm.

The models build their layers from models/ops.py directly (`ops.Linear`, `ops.RMSNorm`, ...): those
classes take their weights through the memory manager and keep torch.nn's constructors and parameter
names, so checkpoints load by name.
"""
from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F
from torch import nn

from kernels.norms import rms_norm as _rms_norm_kernel
from kernels.norms import rope_split_half  # noqa: F401 (the models import it from here)
from models import ops


_ATTENTION_FN: list = []


def _kernel_attention():
    # Resolved once: kernels/attention.py is an optional faster path with the same semantics as SDPA.
    if not _ATTENTION_FN:
        try:
            _ATTENTION_FN.append(importlib.import_module("kernels.attention").attention)
        except (ImportError, AttributeError):
            _ATTENTION_FN.append(None)
    return _ATTENTION_FN[0]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
              *, causal: bool = False) -> torch.Tensor:
    """Scaled dot-product attention over (B, H, S, D) tensors; `mask` is a boolean keep-mask broadcastable to (B, H, S, S)."""
    if causal:
        s_q, s_k = q.shape[-2], k.shape[-2]
        causal_mask = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril(s_k - s_q)
        mask = causal_mask if mask is None else (mask & causal_mask)
    fn = _kernel_attention()
    if fn is not None:
        return fn(q, k, v, mask=mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 (kernels/norms.py)."""
    return _rms_norm_kernel(x, weight, eps)


def compute_device(module: nn.Module) -> torch.device:
    """The device a model's ops run on: the memory manager's when one is configured, else its weights'."""
    from models import memory
    if memory.manager() is not None:
        return memory.compute_device()
    param = next(module.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


class FrameGroupNorm(ops.GroupNorm):
    """GroupNorm whose statistics are computed per frame of a (B, C, T, H, W) tensor, so it stays causal in time.

    Same constructor and parameters (`weight`, `bias`) as torch.nn.GroupNorm.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 5:
            return super().forward(x)
        b, c, t, h, w = x.shape
        frames = x.transpose(1, 2).reshape(b * t, c, h, w)  # (B*T, C, H, W)
        out = super().forward(frames)
        return out.reshape(b, t, c, h, w).transpose(1, 2)
