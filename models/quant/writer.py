"""Quantize float weights into the released formats, with the exact keys and markers ComfyUI reads.

`encode_weight(weight, quant)` turns one float (N, K) weight into its stored tensors by leaf name
(`weight`, `weight_scale`, `weight_scale_2`); `quantize_state_dict(state, layers, ...)` does it
for every selected layer of a state dict and adds the markers in one of three forms: per-layer
`.comfy_quant` tensors (what the released H3 files carry), the header form
`__metadata__["_quantization_metadata"]`, or the legacy scaled-float8 form. `save_quantized` writes
the result as a safetensors file.

Encoding is computed in float32 whatever the input dtype, with round-half-to-even everywhere:
  int8       per-row scale max|W_row| / 127 (at least 1e-30), codes round(W / scale); with a
             rotation group the rows are first multiplied group-wise by the Hadamard matrix.
  float8     scale max|W| / (largest finite value of the float8 type), codes W * (1 / scale), clamped.
  nvfp4      tensor scale g = max|W| / (448 * 6); per 16 columns the block scale
             min(max|block| / 6 / g, 448) rounded to float8-e4m3; codes the nearest E2M1 value of
             W / (g * block scale) (0 where the block is all zero). Padded to 16 x 16.
  mxfp8      per 32 columns the exponent ceil(log2(max|block| / 448)) + 127 clamped to [0, 254],
             codes W / 2^(e - 127) cast to float8-e4m3 (0 where the block is all zero). Padded to 32 x 32.
These are the recipes of comfy-kitchen's eager quantizers; tests/models/quant checks the outputs match.
"""
from __future__ import annotations

import json
import re
from typing import Callable, Iterable

import torch

from kernels.quantized import (FLOAT8_FORMATS, MXFP8_BLOCK, NVFP4_BLOCK, WeightFormat, is_power_of_4, rotate_rows,
                               round_up, swizzle_block_scales)
from models.quant.markers import HEADER_KEY, LEGACY_MARKER, MARKER_SUFFIX, LayerQuant, marker_bytes

MARKER_FORMS = ("tensor", "header", "legacy")
FLOAT8_E4M3_MAX = 448.0
E2M1_MAX = 6.0
# E2M1 magnitudes in code order, and the midpoints between neighbours: a magnitude exactly on a
# midpoint goes to the neighbour with the even code (round half to even on the code).
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_MIDPOINT_TIES_UP = (False, True, False, True, False, True, False)

# The layers the released H3 files quantize (patterns over unprefixed layer names).
RELEASED_INT8_LAYERS = {
    "h3_transformer": r"blocks\.\d+\.(attn\.(qkv_proj|out_proj)|mlp\.(fc1|fc2))",
    "h3_video_vae": r"decoder\.transformer_blocks\.\d+\.(attn\.(to_qkv|to_out)|ff\.(w1|w2))",
}


def rotation_group_for(in_features: int, requested: int) -> int:
    """The largest power of 4 that is at most `requested` and divides `in_features` (0 when none does)."""
    group = requested
    while group >= 4 and in_features % group:
        group //= 4
    return group if group >= 4 and is_power_of_4(group) else 0


def encode_int8(weight: torch.Tensor, rotation_group: int = 0) -> dict[str, torch.Tensor]:
    """int8 codes and per-row float32 scales (N, 1), the rows rotated first when `rotation_group` is set."""
    rows = weight.float()
    if rotation_group:
        rows = rotate_rows(rows, rotation_group)
    scale = (rows.abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=1e-30)
    codes = torch.round(rows / scale).clamp_(-128, 127).to(torch.int8)
    return {"weight": codes, "weight_scale": scale}


def encode_float8(weight: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> dict[str, torch.Tensor]:
    """float8 codes and one float32 scale (max |W| over the type's largest value)."""
    largest = torch.finfo(dtype).max
    values = weight.float()
    scale = (values.abs().amax() / largest).to(torch.float32)
    codes = (values * (1.0 / scale)).clamp(-largest, largest).to(dtype)
    return {"weight": codes, "weight_scale": scale}


def _e2m1_codes(values: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (uint8) of float32 values already within [-6, 6]."""
    magnitude = values.abs()
    code = torch.zeros(values.shape, dtype=torch.uint8, device=values.device)
    for midpoint, ties_up in zip(_E2M1_MIDPOINTS, _MIDPOINT_TIES_UP):
        code += (magnitude >= midpoint if ties_up else magnitude > midpoint).to(torch.uint8)
    return code | (torch.signbit(values).to(torch.uint8) << 3)


def encode_nvfp4(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Packed E2M1 codes (even column in the high nibble), swizzled e4m3 block scales and the tensor scale."""
    values = weight.float()
    rows, cols = values.shape
    padded = torch.nn.functional.pad(values, (0, round_up(cols, NVFP4_BLOCK) - cols, 0, round_up(rows, NVFP4_BLOCK) - rows))
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


def encode_mxfp8(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """float8-e4m3 codes and swizzled E8M0 block exponents (uint8), one per 32 columns."""
    values = weight.float()
    rows, cols = values.shape
    padded = torch.nn.functional.pad(values, (0, round_up(cols, MXFP8_BLOCK) - cols, 0, round_up(rows, MXFP8_BLOCK) - rows))
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


def encode_weight(weight: torch.Tensor, quant: LayerQuant) -> dict[str, torch.Tensor]:
    """The stored tensors of a float (N, K) weight in `quant`'s format, by leaf name."""
    if weight.dim() != 2:
        raise ValueError(f"only 2-D weights are quantized, got shape {tuple(weight.shape)}")
    fmt = quant.format
    if fmt is WeightFormat.INT8:
        return encode_int8(weight, quant.rotation_group)
    if fmt in FLOAT8_FORMATS:
        return encode_float8(weight, FLOAT8_FORMATS[fmt])
    if fmt is WeightFormat.NVFP4:
        return encode_nvfp4(weight)
    if fmt is WeightFormat.MXFP8:
        return encode_mxfp8(weight)
    raise ValueError(f"no encoder for weight format {fmt}")


def _selector(layers: str | Iterable[str] | Callable[[str], bool]) -> Callable[[str], bool]:
    if callable(layers):
        return layers
    if isinstance(layers, str):
        pattern = re.compile(layers)
        return lambda name: pattern.fullmatch(name) is not None
    chosen = set(layers)
    return chosen.__contains__


def quantize_state_dict(state: dict[str, torch.Tensor], layers: str | Iterable[str] | Callable[[str], bool],
                        fmt: WeightFormat | str, *, rotation_group: int = 0, full_precision: bool = False,
                        marker_form: str = "tensor", prefix: str = "") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, header metadata) of `state` with the selected layers' 2-D `weight`s quantized to `fmt`.

    layers: a regular expression matched against whole layer names (without `prefix`), a collection
    of names, or a predicate. rotation_group: int8 only; each layer uses the largest power of 4 up to
    it that divides its input width (0: no rotation). marker_form: "tensor" (per-layer `.comfy_quant`),
    "header" (`_quantization_metadata`) or "legacy" (`scaled_fp8` + `scale_weight`, float8-e4m3 only).
    Other tensors pass through unchanged. Raises ValueError when no layer is selected.
    """
    try:
        fmt = WeightFormat(fmt)
    except ValueError:
        raise ValueError(f"cannot write weight format {fmt!r}; supported formats: "
                         f"{', '.join(f.value for f in WeightFormat)}") from None
    if marker_form not in MARKER_FORMS:
        raise ValueError(f"marker_form must be one of {MARKER_FORMS}, got {marker_form!r}")
    if marker_form == "legacy" and fmt is not WeightFormat.FLOAT8_E4M3:
        raise ValueError(f"the legacy scaled_fp8 form exists for float8_e4m3fn only, not {fmt.value}")
    if rotation_group and fmt is not WeightFormat.INT8:
        raise ValueError(f"rotation applies to int8_tensorwise only, not {fmt.value}")
    selected = _selector(layers)
    out: dict[str, torch.Tensor] = {}
    header_layers: dict[str, dict] = {}
    for key, tensor in state.items():
        layer, _, leaf = key[len(prefix):].rpartition(".")
        if not (key.startswith(prefix) and leaf == "weight" and tensor.dim() == 2 and selected(layer)):
            out.setdefault(key, tensor)
            continue
        group = rotation_group_for(tensor.shape[1], rotation_group) if rotation_group else 0
        quant = LayerQuant(fmt, group, full_precision)
        for name, stored in encode_weight(tensor, quant).items():
            out[f"{prefix}{layer}.{name}"] = stored.contiguous()
        if marker_form == "tensor":
            out[f"{prefix}{layer}{MARKER_SUFFIX}"] = marker_bytes(quant.marker())
        elif marker_form == "header":
            header_layers[prefix + layer] = quant.marker()
        else:
            out[f"{prefix}{layer}.scale_weight"] = out.pop(f"{prefix}{layer}.weight_scale")
    if not any(k.endswith((".weight_scale", ".scale_weight")) for k in out):
        raise ValueError(f"no layer of the state dict was selected for {fmt.value} quantization")
    metadata: dict[str, str] = {}
    if marker_form == "header":
        metadata[HEADER_KEY] = json.dumps({"layers": header_layers})
    elif marker_form == "legacy":
        out[prefix + LEGACY_MARKER] = torch.zeros((2,) if full_precision else (), dtype=torch.float32)
    return out, metadata


def save_quantized(path: str, state: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write quantized tensors (from quantize_state_dict) and header metadata as a safetensors file."""
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in state.items()}, str(path), metadata=metadata or None)
