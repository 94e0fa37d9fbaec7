"""int8_tensorwise, plain or rotated ("convrot"): int8 codes (N, K) and float32 row scales (N, 1).

A rotated layer's stored rows are W @ blockdiag(H) for the regular normalized Hadamard H of the
marker's group size (a power of 4 dividing K); kernels rotate it back when dequantizing and rotate
the activation the same way for the int8 product (kernels/quantized_linear.py's int8 backends).
"""
from __future__ import annotations

import torch

from kernels.quantized import WeightFormat, is_power_of_4, rotate_rows
from models.quant.formats.base import LayerQuant, QuantFormat, StoredTensors

DEFAULT_ROTATION_GROUP = 256
INT8_MAX = 127.0


def rotation_group_for(in_features: int, requested: int) -> int:
    """The largest power of 4 that is at most `requested` and divides `in_features` (0 when none does)."""
    group = requested
    while group >= 4 and in_features % group:
        group //= 4
    return group if group >= 4 and is_power_of_4(group) else 0


def encode_int8(weight: torch.Tensor, rotation_group: int = 0) -> dict[str, torch.Tensor]:
    """int8 codes and per-row float32 scales (N, 1), the rows rotated first when `rotation_group` is set.

    Computed in float32: scale max|W_row| / 127 (at least 1e-30), codes round-half-even(W / scale).
    """
    rows = weight.float()
    if rotation_group:
        rows = rotate_rows(rows, rotation_group)
    scale = (rows.abs().amax(dim=-1, keepdim=True) / INT8_MAX).clamp(min=1e-30)
    codes = torch.round(rows / scale).clamp_(-128, 127).to(torch.int8)
    return {"weight": codes, "weight_scale": scale}


class Int8Tensorwise(QuantFormat):
    """int8 codes with a scale per row (or one for the tensor), optionally Hadamard-rotated in groups."""

    arithmetic = WeightFormat.INT8
    code_dtypes = ("I8",)
    scales = StoredTensors(required=("weight_scale",))
    embeddable = True
    rotates = True

    def read_options(self, layer: str, conf: dict, params: dict, where: str) -> LayerQuant:
        full_precision = bool(conf.get("full_precision_matrix_mult", False))
        if not conf.get("convrot", params.get("convrot", False)):
            return LayerQuant(self.arithmetic, 0, full_precision)
        group = conf.get("convrot_groupsize", params.get("convrot_groupsize", DEFAULT_ROTATION_GROUP))
        # A marker is JSON from a file: a string, float or bool here is a malformed marker, not a number to coerce.
        if isinstance(group, bool) or not isinstance(group, int) or not is_power_of_4(group):
            raise ValueError(f"{where}: layer {layer!r} has convrot_groupsize {group!r}; the rotation is defined for "
                             "powers of 4 (4, 16, 64, 256, ...)")
        return LayerQuant(self.arithmetic, group, full_precision)

    def marker(self, quant: LayerQuant) -> dict:
        conf = super().marker(quant)
        if quant.rotation_group:
            conf["convrot"] = True
            conf["convrot_groupsize"] = quant.rotation_group
        return conf

    def scale_elements(self, leaf: str, out_features: int, in_features: int) -> tuple[int, ...]:
        return (1, out_features)

    def check_stored(self, layer, quant, sources, out_features, in_features, shapes, dtypes, where) -> None:
        super().check_stored(layer, quant, sources, out_features, in_features, shapes, dtypes, where)
        if quant.rotation_group and in_features % quant.rotation_group:
            raise ValueError(f"{where}: layer {layer!r} has convrot_groupsize {quant.rotation_group}, which does not "
                             f"divide its {in_features} input features")

    def encode(self, weight: torch.Tensor, quant: LayerQuant) -> dict[str, torch.Tensor]:
        return encode_int8(weight, quant.rotation_group)

    def writer_options(self, in_features: int, rotation_group: int, full_precision: bool) -> LayerQuant:
        group = rotation_group_for(in_features, rotation_group) if rotation_group else 0
        return LayerQuant(self.arithmetic, group, full_precision)


INT8_TENSORWISE = Int8Tensorwise()
