"""Quantize float weights into the released formats, with the exact keys and markers ComfyUI reads.

`encode_weight(weight, quant)` turns one float (N, K) weight into its stored tensors by leaf name
(asking the layer's format object, models/quant/formats/); `quantize_state_dict(state, layers, ...)`
does it for every selected layer of a state dict and adds the markers in one of three forms:
per-layer `.comfy_quant` tensors (what the released H3 files carry), the header form
`__metadata__["_quantization_metadata"]`, or the legacy scaled-float8 form. `save_quantized`
writes the result as a safetensors file.

Each format's encoder is in its own module (the recipes of comfy-kitchen's eager quantizers, in
float32 with round-half-to-even; tests/models/quant checks the outputs match) and is importable
from here too, for code that writes files.
"""
from __future__ import annotations

import json
import re
from typing import Callable, Iterable

import torch

from kernels.quantized import WeightFormat
from models.quant.formats import FORMATS, SUPPORTED_FORMATS, LayerQuant
from models.quant.formats.float8 import LEGACY_LEAVES, LEGACY_MARKER, encode_float8
from models.quant.formats.int8 import encode_int8, rotation_group_for
from models.quant.formats.mxfp8 import encode_mxfp8
from models.quant.formats.nvfp4 import encode_nvfp4
from models.quant.markers import HEADER_KEY, MARKER_SUFFIX, marker_bytes

__all__ = ["MARKER_FORMS", "RELEASED_INT8_LAYERS", "encode_float8", "encode_int8", "encode_mxfp8", "encode_nvfp4",
           "encode_weight", "quantize_state_dict", "rotation_group_for", "save_quantized"]

MARKER_FORMS = ("tensor", "header", "legacy")

# The layers the released H3 files quantize (patterns over unprefixed layer names).
RELEASED_INT8_LAYERS = {
    "h3_transformer": r"blocks\.\d+\.(attn\.(qkv_proj|out_proj)|mlp\.(fc1|fc2))",
    "h3_video_vae": r"decoder\.transformer_blocks\.\d+\.(attn\.(to_qkv|to_out)|ff\.(w1|w2))",
}


def encode_weight(weight: torch.Tensor, quant: LayerQuant) -> dict[str, torch.Tensor]:
    """The stored tensors of a float (N, K) weight in `quant`'s format, by leaf name."""
    if weight.dim() != 2:
        raise ValueError(f"only 2-D weights are quantized, got shape {tuple(weight.shape)}")
    return quant.stored_format.encode(weight, quant)


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
        stored_format = FORMATS[WeightFormat(fmt)]
    except (ValueError, KeyError):
        raise ValueError(f"cannot write weight format {fmt!r}; supported formats: "
                         f"{', '.join(SUPPORTED_FORMATS)}") from None
    if not stored_format.marked:
        raise ValueError(f"{stored_format.name} layers are written into .gguf files (models/gguf.py), not marked in "
                         "a safetensors file")
    if marker_form not in MARKER_FORMS:
        raise ValueError(f"marker_form must be one of {MARKER_FORMS}, got {marker_form!r}")
    if marker_form == "legacy" and not stored_format.writes_legacy_form:
        raise ValueError(f"the legacy scaled_fp8 form exists for float8_e4m3fn only, not {stored_format.name}")
    if rotation_group and not stored_format.rotates:
        raise ValueError(f"rotation applies to int8_tensorwise only, not {stored_format.name}")
    selected = _selector(layers)
    out: dict[str, torch.Tensor] = {}
    header_layers: dict[str, dict] = {}
    for key, tensor in state.items():
        layer, _, leaf = key[len(prefix):].rpartition(".")
        if not (key.startswith(prefix) and leaf == "weight" and tensor.dim() == 2 and selected(layer)):
            out.setdefault(key, tensor)
            continue
        quant = stored_format.writer_options(tensor.shape[1], rotation_group, full_precision)
        for name, stored in encode_weight(tensor, quant).items():
            out[f"{prefix}{layer}.{name}"] = stored.contiguous()
        if marker_form == "tensor":
            out[f"{prefix}{layer}{MARKER_SUFFIX}"] = marker_bytes(quant.marker())
        elif marker_form == "header":
            header_layers[prefix + layer] = quant.marker()
        else:
            out[f"{prefix}{layer}.{LEGACY_LEAVES['weight_scale']}"] = out.pop(f"{prefix}{layer}.weight_scale")
    if not any(k.endswith((".weight_scale", ".scale_weight")) for k in out):
        raise ValueError(f"no layer of the state dict was selected for {stored_format.name} quantization")
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
