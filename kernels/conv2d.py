"""2-D convolution, stride 1 with zero padding, one backend chosen per call (the taeh3 preview decoder's).

Backends, in priority order:
- `native`: ATen's own kernel (`aten.thnn_conv2d`: unfold the patches, one matrix product), for float32 on
  the CPU when the call is small. There oneDNN, which `F.conv2d` picks for any batch of more than one
  picture, spends most of a call on set-up: at the tiny taeh3's shapes (8 to 48 channels, 4x6 to 32x48
  pixels, up to 4 pictures; 2^18 to 2^21 multiply-adds) the native kernel took 35-80 us a call against
  oneDNN's 80-110 us on one thread of an AVX2 CPU. From about 2^21 multiply-adds oneDNN's faster
  arithmetic wins (2^23: oneDNN 0.43 ms, native 0.51 ms; a released taeh3's first stage at 720p, 2^28:
  about 2x), so larger calls are not worth moving (`NATIVE_MAX_MACS`).
- `eager`: `F.conv2d`, the reference (oneDNN on the CPU, cuDNN on CUDA).
Both compute the same sums in float32; they may differ in the last bits (summation order).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.registry import KernelRegistry

NATIVE_MAX_MACS = 1 << 21  # above this many multiply-adds per call oneDNN's arithmetic repays its set-up
# ATen's kernel through torch's own binding for nn functions (a few microseconds less per call than the
# torch.ops route, which it falls back to).
_thnn_conv2d = getattr(torch._C._nn, "thnn_conv2d", None) or torch.ops.aten.thnn_conv2d


def conv2d_eager(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 padding: int = 0) -> torch.Tensor:
    """The reference: `F.conv2d` with stride 1."""
    return F.conv2d(x, weight, bias, padding=padding)


def _native_check(x, weight, bias=None, *, padding=0) -> str | None:
    if x.device.type != "cpu":
        return "the native kernel is for CPU tensors"
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or (bias is not None and bias.dtype != torch.float32):
        return "the native kernel is used for float32 only"
    return None


def _native_worthwhile(x, weight, bias=None, *, padding=0) -> str | None:
    n, _, h, w = x.shape
    out_h, out_w = h + 2 * padding - weight.shape[2] + 1, w + 2 * padding - weight.shape[3] + 1
    macs = n * out_h * out_w * weight[0].numel() * weight.shape[0]
    if macs > NATIVE_MAX_MACS:
        return f"{macs} multiply-adds: oneDNN is faster above {NATIVE_MAX_MACS}"
    return None


def conv2d_native(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  padding: int = 0) -> torch.Tensor:
    """ATen's unfold-and-multiply convolution (CPU, float32)."""
    return _thnn_conv2d(x, weight, weight.shape[2:], bias, (1, 1), (padding, padding))


CONV2D = KernelRegistry("conv2d")
CONV2D.register("eager", conv2d_eager)
CONV2D.register("native", conv2d_native, check=_native_check, worthwhile=_native_worthwhile, before="eager")


def conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           padding: int = 0, backend: str | None = None) -> torch.Tensor:
    """x (N, C_in, H, W) -> (N, C_out, H + 2 padding - kH + 1, W + 2 padding - kW + 1), stride 1; `backend`
    forces one (see kernels/registry.py)."""
    if x.dim() != 4 or weight.dim() != 4 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"conv2d: input {tuple(x.shape)} does not fit weight {tuple(weight.shape)} "
                         "(expected (N, C_in, H, W) and (C_out, C_in, kH, kW))")
    memo_key = (tuple(x.shape), tuple(weight.shape), x.dtype, weight.dtype, x.device, bias is not None, padding)
    if backend is not None:
        return CONV2D(x, weight, bias, padding=padding, backend=backend)
    chosen = CONV2D.remembered(memo_key)
    if chosen is not None:
        return CONV2D.run_remembered(chosen, memo_key, x, weight, bias, padding=padding)
    return CONV2D(x, weight, bias, padding=padding, memo_key=memo_key)
