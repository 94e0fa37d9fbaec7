"""Attention: `softmax(q @ k.T * scale + mask) @ v` over (B, heads, tokens, head_dim) tensors.

One public function, `attention`, with two backend registries (kernels/registry.py):
  attention       sdpa   PyTorch's scaled_dot_product_attention (flash / memory-efficient kernels where
                         the device has them); the default
                  eager  the reference, float32 softmax
  attention_int8  int8   q and k quantised to int8 per block of `INT8_BLOCK` tokens (one scale per block
                         per head), k smoothed by its mean over tokens first (softmax ignores a per-query
                         constant, and the smoothed k quantises with less error); for decoders whose
                         weights are int8-quantised. Products of int8 values are summed exactly in
                         float32 (head_dim * 127^2 < 2^24), so this is what an int8 matrix product computes.
                  eager  the unquantised reference, the fallback when the int8 path declines
Both int8-path backends return `nan_to_num` of their output: a row whose keys are all masked gives
zeros instead of NaN.

`mask` is either boolean (True = attend) or additive (float, -inf to block), broadcastable to
(B, heads, q_tokens, k_tokens).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kernels.registry import KernelRegistry

INT8_BLOCK = 64  # tokens per quantisation block of q and k
_INT8_EXACT_HEAD_DIM = (1 << 24) // (127 * 127)  # float32 sums int8 products exactly up to this head_dim


def _scores_mask(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return scores
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask, float("-inf"))
    return scores + mask.float()


def attention_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None = None,
                    scale: float | None = None) -> torch.Tensor:
    """The reference: float32 scores and softmax, output in q's dtype."""
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale  # (B, H, L, S)
    probs = torch.softmax(_scores_mask(scores, mask), dim=-1)
    return (probs @ v.float()).to(q.dtype)  # (B, H, L, D)


def attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None = None,
                   scale: float | None = None) -> torch.Tensor:
    """PyTorch's fused scaled-dot-product attention."""
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _sdpa_check(q, k, v, *, mask=None, scale=None) -> str | None:
    if not (q.dtype == k.dtype == v.dtype):
        return f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})"
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {q.dtype} is not float32/float16/bfloat16"
    return None


def quantize_per_block(t: torch.Tensor, block: int = INT8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values of t (B, H, L, D) and their scales (B, H, L, 1): one scale per `block` tokens per head."""
    batch, heads, tokens, dim = t.shape
    blocks = math.ceil(tokens / block)
    padded = F.pad(t.float(), (0, 0, 0, blocks * block - tokens))
    grouped = padded.view(batch, heads, blocks, block, dim)
    amax = grouped.abs().amax(dim=(3, 4), keepdim=True)  # (B, H, blocks, 1, 1)
    block_scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    values = torch.round(grouped / block_scale).clamp_(-127, 127).to(torch.int8)
    values = values.view(batch, heads, blocks * block, dim)[:, :, :tokens]
    scales = block_scale.expand(batch, heads, blocks, block, 1).reshape(batch, heads, blocks * block, 1)[:, :, :tokens]
    return values, scales


def attention_int8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None = None,
                   scale: float | None = None) -> torch.Tensor:
    """Attention with q and k quantised to int8 per block (k mean-smoothed first)."""
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    k_smooth = k.float() - k.float().mean(dim=-2, keepdim=True)
    q_values, q_scales = quantize_per_block(q)
    k_values, k_scales = quantize_per_block(k_smooth)
    # The integer product, then one rescale per (query block, key block) pair.
    scores = q_values.float() @ k_values.float().transpose(-1, -2)  # (B, H, L, S)
    scores = scores * (q_scales * scale) * k_scales.transpose(-1, -2)
    probs = torch.softmax(_scores_mask(scores, mask), dim=-1)
    return torch.nan_to_num(probs @ v.float()).to(q.dtype)


def _int8_check(q, k, v, *, mask=None, scale=None) -> str | None:
    if q.shape[-1] > _INT8_EXACT_HEAD_DIM:
        return f"head_dim {q.shape[-1]} > {_INT8_EXACT_HEAD_DIM}: float32 would not sum the int8 products exactly"
    if not q.is_floating_point():
        return f"dtype {q.dtype} is not floating point"
    return None


def _int8_fallback(q, k, v, *, mask=None, scale=None) -> torch.Tensor:
    return torch.nan_to_num(attention_eager(q, k, v, mask=mask, scale=scale))


ATTENTION = KernelRegistry("attention")
ATTENTION.register("sdpa", attention_sdpa, check=_sdpa_check)
ATTENTION.register("eager", attention_eager)

ATTENTION_INT8 = KernelRegistry("attention_int8")
ATTENTION_INT8.register("int8", attention_int8, check=_int8_check)
ATTENTION_INT8.register("eager", _int8_fallback)


def check_arguments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> None:
    """Raise ValueError naming the shapes when q, k, v, mask do not fit together."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"attention: q, k, v must be (B, heads, tokens, head_dim); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"attention: shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if mask is not None:
        scores = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        try:
            fits = torch.broadcast_shapes(mask.shape, scores) == torch.Size(scores)
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"attention: mask {tuple(mask.shape)} does not broadcast to the scores {scores}")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None = None,
              backend: str | None = None, scale: float | None = None, int8_qk: bool = False) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v: q (B, H, L, D), k/v (B, H, S, D) -> (B, H, L, D).

    `int8_qk=True` selects the int8 path (see module docstring); `backend` forces one backend of
    the selected path.
    """
    check_arguments(q, k, v, mask)
    registry = ATTENTION_INT8 if int8_qk else ATTENTION
    return registry(q, k, v, mask=mask, scale=scale, backend=backend)
