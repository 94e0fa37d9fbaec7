"""float8_e4m3fn and float8_e5m2: float8 codes (N, K) and one float32 scale; maybe an `input_scale`.

Besides the marker forms every format has, these two are also read in the legacy scaled-float8
form: a `scaled_fp8` tensor beside the weights (float8-e5m2 means e5m2, any other dtype e4m3fn;
two elements ask for full-precision products), and per layer `<layer>.scale_weight` read as
`weight_scale` and maybe `<layer>.scale_input` read as `input_scale` (ignored when exactly 1).
"""
from __future__ import annotations

import torch

from kernels.quantized import FLOAT8_FORMATS, WeightFormat
from models.quant.formats.base import LayerQuant, QuantFormat, StoredTensors

LEGACY_MARKER = "scaled_fp8"
# The legacy form's leaf names, by the names every other form uses.
LEGACY_LEAVES = {"weight_scale": "scale_weight", "input_scale": "scale_input"}


def encode_float8(weight: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> dict[str, torch.Tensor]:
    """float8 codes and one float32 scale (max |W| over the type's largest value), computed in float32."""
    largest = torch.finfo(dtype).max
    values = weight.float()
    scale = (values.abs().amax() / largest).to(torch.float32)
    codes = (values * (1.0 / scale)).clamp(-largest, largest).to(dtype)
    return {"weight": codes, "weight_scale": scale}


class Float8(QuantFormat):
    """float8 codes times one tensor scale; products on float8 matrix units where the device has them."""

    scales = StoredTensors(required=("weight_scale",), optional=("input_scale",))
    embeddable = True

    def __init__(self, arithmetic: WeightFormat, code_dtype: str, writes_legacy_form: bool) -> None:
        self.arithmetic = arithmetic
        self.code_dtypes = (code_dtype,)
        self.writes_legacy_form = writes_legacy_form  # the legacy form is written for e4m3fn only
        self.torch_dtype = FLOAT8_FORMATS[arithmetic]

    def scale_elements(self, leaf: str, out_features: int, in_features: int) -> tuple[int, ...]:
        return (1,)

    def encode(self, weight: torch.Tensor, quant: LayerQuant) -> dict[str, torch.Tensor]:
        return encode_float8(weight, self.torch_dtype)


FLOAT8_E4M3FN = Float8(WeightFormat.FLOAT8_E4M3, "F8_E4M3", writes_legacy_form=True)
FLOAT8_E5M2 = Float8(WeightFormat.FLOAT8_E5M2, "F8_E5M2", writes_legacy_form=False)


def legacy_format(marker: torch.Tensor) -> tuple[Float8, bool]:
    """(format, full precision) a legacy `scaled_fp8` marker tensor stands for."""
    fmt = FLOAT8_E5M2 if marker.dtype == torch.float8_e5m2 else FLOAT8_E4M3FN
    return fmt, marker.numel() == 2
