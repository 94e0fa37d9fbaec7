"""nvfp4: E2M1 codes two per byte, float8-e4m3 scales per 16 columns (swizzled), and a tensor scale.

Stored for an (N, K) weight: `weight` uint8 (N16, K16 / 2) with N16, K16 = N, K rounded up to 16
and the even column in the high nibble; `weight_scale` the e4m3 block scales in the 128x4
swizzled layout (kernels/quantized.py); `weight_scale_2` one float32; maybe `input_scale` and a
per-column `pre_quant_scale` that multiplies the activation before the product.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kernels.quantized import NVFP4_BLOCK, WeightFormat, block_scale_shape, round_up, swizzle_block_scales
from models.quant.formats.base import LayerQuant, QuantFormat, StoredTensors

FLOAT8_E4M3_MAX = 448.0
E2M1_MAX = 6.0
# E2M1 magnitudes in code order, and the midpoints between neighbours: a magnitude exactly on a
# midpoint goes to the neighbour with the even code (round half to even on the code).
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_MIDPOINT_TIES_UP = (False, True, False, True, False, True, False)


def _e2m1_codes(values: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (uint8) of float32 values already within [-6, 6]."""
    magnitude = values.abs()
    code = torch.zeros(values.shape, dtype=torch.uint8, device=values.device)
    for midpoint, ties_up in zip(_E2M1_MIDPOINTS, _MIDPOINT_TIES_UP):
        code += (magnitude >= midpoint if ties_up else magnitude > midpoint).to(torch.uint8)
    return code | (torch.signbit(values).to(torch.uint8) << 3)


def encode_nvfp4(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Packed E2M1 codes (even column in the high nibble), swizzled e4m3 block scales and the tensor scale.

    In float32: tensor scale g = max|W| / (448 * 6); per 16 columns the block scale
    min(max|block| / 6 / g, 448) rounded to e4m3; codes the nearest E2M1 value of
    W / (g * block scale), 0 where the block is all zero.
    """
    values = weight.float()
    rows, cols = values.shape
    padded = F.pad(values, (0, round_up(cols, NVFP4_BLOCK) - cols, 0, round_up(rows, NVFP4_BLOCK) - rows))
    tensor_scale = (values.abs().amax() / (FLOAT8_E4M3_MAX * E2M1_MAX)).to(torch.float32)
    blocks = padded.view(padded.shape[0], -1, NVFP4_BLOCK)
    block_scale = (blocks.abs().amax(dim=-1) / E2M1_MAX / tensor_scale).clamp(max=FLOAT8_E4M3_MAX)
    block_scale = block_scale.to(torch.float8_e4m3fn)
    total = tensor_scale * block_scale.to(torch.float32)
    zero = total == 0
    scaled = blocks / torch.where(zero, torch.ones_like(total), total).unsqueeze(-1)
    scaled = torch.where(zero.unsqueeze(-1), torch.zeros_like(scaled), scaled).clamp(-E2M1_MAX, E2M1_MAX)
    codes = _e2m1_codes(scaled.view(padded.shape))
    packed = (codes[:, 0::2] << 4) | codes[:, 1::2]
    return {"weight": packed, "weight_scale": swizzle_block_scales(block_scale), "weight_scale_2": tensor_scale}


class Nvfp4(QuantFormat):
    """4-bit E2M1 codes with two-level scales; multiplied by dequantize-then-matmul."""

    arithmetic = WeightFormat.NVFP4
    code_dtypes = ("U8",)
    scales = StoredTensors(required=("weight_scale", "weight_scale_2"), optional=("input_scale", "pre_quant_scale"))

    def storage_shape(self, out_features: int, in_features: int) -> tuple[int, int]:
        return round_up(out_features, NVFP4_BLOCK), round_up(in_features, NVFP4_BLOCK) // 2

    def dense_shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        return (stored[0], stored[1] * 2) if len(stored) == 2 else tuple(stored)

    def scale_elements(self, leaf: str, out_features: int, in_features: int) -> tuple[int, ...]:
        if leaf in ("weight_scale_2", "input_scale"):
            return (1,)
        if leaf == "pre_quant_scale":
            return (in_features,)
        rows, cols = self.storage_shape(out_features, in_features)
        return (math.prod(block_scale_shape(rows, cols * 2 // NVFP4_BLOCK)),)

    def encode(self, weight: torch.Tensor, quant: LayerQuant) -> dict[str, torch.Tensor]:
        return encode_nvfp4(weight)


NVFP4 = Nvfp4()
