"""mxfp8: float8-e4m3 codes and E8M0 exponents per 32 columns (swizzled).

Stored for an (N, K) weight: `weight` float8-e4m3 (N32, K32) with N32, K32 = N, K rounded up to
32; `weight_scale` the uint8 exponents e (value 2^(e - 127), e = 0 meaning zero) in the 128x4
swizzled layout (kernels/quantized.py).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kernels.quantized import MXFP8_BLOCK, WeightFormat, block_scale_shape, round_up, swizzle_block_scales
from models.quant.formats.base import LayerQuant, QuantFormat, StoredTensors

FLOAT8_E4M3_MAX = 448.0


def encode_mxfp8(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """float8-e4m3 codes and swizzled E8M0 block exponents (uint8), one per 32 columns.

    In float32: per block the exponent ceil(log2(max|block| / 448)) + 127 clamped to [0, 254],
    codes W / 2^(e - 127) cast to e4m3, 0 where the block is all zero.
    """
    values = weight.float()
    rows, cols = values.shape
    padded = F.pad(values, (0, round_up(cols, MXFP8_BLOCK) - cols, 0, round_up(rows, MXFP8_BLOCK) - rows))
    blocks = padded.view(padded.shape[0], -1, MXFP8_BLOCK)
    largest = blocks.abs().amax(dim=-1)
    needed = (largest / FLOAT8_E4M3_MAX).clamp(min=2.0 ** -127)
    exponent = (torch.ceil(torch.log2(needed)).to(torch.int32) + 127).clamp(0, 254)
    zero = largest == 0
    exponent = torch.where(zero, torch.zeros_like(exponent), exponent)
    block_value = torch.where(zero, torch.ones_like(largest), torch.exp2((exponent - 127).float()))
    scaled = (blocks / block_value.unsqueeze(-1)).clamp(-FLOAT8_E4M3_MAX, FLOAT8_E4M3_MAX)
    codes = scaled.view(padded.shape).to(torch.float8_e4m3fn)
    return {"weight": codes, "weight_scale": swizzle_block_scales(exponent.to(torch.uint8))}


class Mxfp8(QuantFormat):
    """float8-e4m3 codes with power-of-two block scales; multiplied by dequantize-then-matmul."""

    arithmetic = WeightFormat.MXFP8
    code_dtypes = ("F8_E4M3",)
    scales = StoredTensors(required=("weight_scale",))

    def storage_shape(self, out_features: int, in_features: int) -> tuple[int, int]:
        return round_up(out_features, MXFP8_BLOCK), round_up(in_features, MXFP8_BLOCK)

    def scale_elements(self, leaf: str, out_features: int, in_features: int) -> tuple[int, ...]:
        rows, cols = self.storage_shape(out_features, in_features)
        return (math.prod(block_scale_shape(rows, cols // MXFP8_BLOCK)),)

    def encode(self, weight: torch.Tensor, quant: LayerQuant) -> dict[str, torch.Tensor]:
        return encode_mxfp8(weight)


MXFP8 = Mxfp8()
