"""Which layers of a safetensors file are quantized, and how: ComfyUI's three ways of saying so.

1. A per-layer marker tensor `<layer>.comfy_quant`: uint8, the UTF-8 bytes of a JSON object such as
   `{"format": "int8_tensorwise", "convrot": true, "convrot_groupsize": 256}`.
2. The header form: `__metadata__["_quantization_metadata"]` holds `{"layers": {"<layer>": {...}}}`
   with the same per-layer objects; where both forms name a layer, the header wins.
3. The legacy float8 form (only when there is no header form): a `scaled_fp8` tensor beside the
   weights (float32 means e4m3fn, as does any other dtype here; two elements ask for full precision
   products), each scaled layer carrying `<layer>.scale_weight` (read as `weight_scale`) and maybe
   `<layer>.scale_input` (read as `input_scale`, ignored when it is exactly 1).

`read_plan` turns any of them into one `QuantPlan`: a `LayerQuant` per layer, and the file keys each
layer's tensors are read from. A marker naming a format Weft does not read is refused with the
layer, the format found and the formats supported.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from kernels.quantized import WeightFormat, is_power_of_4

MARKER_SUFFIX = ".comfy_quant"
HEADER_KEY = "_quantization_metadata"
LEGACY_MARKER = "scaled_fp8"
SUPPORTED_FORMATS = tuple(fmt.value for fmt in WeightFormat)
# Tensors a quantized layer may carry beside `weight` (and `bias`), by format.
EXTRA_TENSORS = {
    WeightFormat.INT8: ("weight_scale",),
    WeightFormat.FLOAT8_E4M3: ("weight_scale", "input_scale"),
    WeightFormat.FLOAT8_E5M2: ("weight_scale", "input_scale"),
    WeightFormat.NVFP4: ("weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale"),
    WeightFormat.MXFP8: ("weight_scale",),
}
REQUIRED_TENSORS = {
    WeightFormat.INT8: ("weight_scale",),
    WeightFormat.FLOAT8_E4M3: ("weight_scale",),
    WeightFormat.FLOAT8_E5M2: ("weight_scale",),
    WeightFormat.NVFP4: ("weight_scale", "weight_scale_2"),
    WeightFormat.MXFP8: ("weight_scale",),
}
DEFAULT_ROTATION_GROUP = 256


@dataclass(frozen=True)
class LayerQuant:
    """How one layer's weight is stored: its format and the options its marker sets."""

    format: WeightFormat
    rotation_group: int = 0         # int8 "convrot" Hadamard group size; 0 = not rotated
    full_precision: bool = False    # `full_precision_matrix_mult`: dequantize, then a float product

    def marker(self) -> dict:
        """The marker JSON object ComfyUI writes for this layer (key order as ComfyUI's writer has it)."""
        conf: dict = {"format": self.format.value}
        if self.full_precision:
            conf["full_precision_matrix_mult"] = True
        if self.rotation_group:
            conf["convrot"] = True
            conf["convrot_groupsize"] = self.rotation_group
        return conf


@dataclass
class QuantPlan:
    """The quantized layers of a file: `layers[name]`, and `sources[name][tensor] = file key` for their tensors."""

    layers: dict[str, LayerQuant] = field(default_factory=dict)
    sources: dict[str, dict[str, str]] = field(default_factory=dict)
    marker_keys: set[str] = field(default_factory=set)  # file keys that only mark (read, never loaded)


def marker_bytes(conf: dict) -> torch.Tensor:
    """A `.comfy_quant` tensor for a marker object: uint8 UTF-8 JSON with json.dumps' default separators."""
    return torch.tensor(list(json.dumps(conf).encode("utf-8")), dtype=torch.uint8)


def parse_marker(layer: str, conf: object, where: str) -> LayerQuant:
    """The LayerQuant a marker object describes; ValueError naming the layer and the format otherwise."""
    if not isinstance(conf, dict):
        raise ValueError(f"{where}: layer {layer!r} has a quantization marker that is not a JSON object: {conf!r}")
    params = conf.get("params") if isinstance(conf.get("params"), dict) else {}
    name = conf.get("format")
    if name is None:
        raise ValueError(f"{where}: layer {layer!r} has a quantization marker without a \"format\" "
                         f"(found keys {sorted(conf)}); supported formats: {', '.join(SUPPORTED_FORMATS)}")
    try:
        fmt = WeightFormat(name)
    except ValueError:
        raise ValueError(f"{where}: layer {layer!r} is quantized in format {name!r}, which Weft does not read; "
                         f"supported formats: {', '.join(SUPPORTED_FORMATS)}") from None
    if conf.get("num_experts"):
        raise ValueError(f"{where}: layer {layer!r} is a {name} mixture-of-experts table (num_experts "
                         f"{conf['num_experts']}); Weft reads quantized Linear and Embedding layers only")
    rotated = bool(conf.get("convrot", params.get("convrot", False)))
    group = 0
    if rotated:
        if fmt is not WeightFormat.INT8:
            raise ValueError(f"{where}: layer {layer!r} asks for a convrot rotation in format {name!r}; "
                             "only int8_tensorwise weights are rotated")
        group = conf.get("convrot_groupsize", params.get("convrot_groupsize", DEFAULT_ROTATION_GROUP))
        if isinstance(group, bool) or not isinstance(group, int) or not is_power_of_4(group):
            raise ValueError(f"{where}: layer {layer!r} has convrot_groupsize {group!r}; the rotation is defined for "
                             "powers of 4 (4, 16, 64, 256, ...)")
    return LayerQuant(fmt, group, bool(conf.get("full_precision_matrix_mult", False)))


def read_plan(keys: list[str], prefix: str, metadata: dict[str, str], read_tensor, where: str) -> QuantPlan:
    """The quantized layers of a file whose tensor names are `keys`, for a model under `prefix`.

    Layer names in the plan are without the prefix; `sources` holds full file keys. `read_tensor(key)`
    returns one tensor of the file (called for marker tensors only); `where` names the file in
    errors. A file without quantization of any form gives an empty plan.
    """
    plan = QuantPlan()
    key_set = set(keys)
    confs: dict[str, object] = {}
    for key in keys:
        if key.startswith(prefix) and key.endswith(MARKER_SUFFIX):
            raw = read_tensor(key)
            try:
                confs[key[len(prefix):-len(MARKER_SUFFIX)]] = json.loads(raw.numpy().tobytes().decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
                raise ValueError(f"{where}: {key!r} is not a JSON quantization marker ({error})") from None
            plan.marker_keys.add(key)
    header = metadata.get(HEADER_KEY)
    if header:
        try:
            layers = json.loads(header)["layers"]
            items = list(layers.items())
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError, RecursionError) as error:
            raise ValueError(f"{where}: __metadata__[{HEADER_KEY!r}] is not a JSON object with \"layers\" "
                             f"({type(error).__name__}: {error})") from None
        for layer, conf in items:  # the header wins over marker tensors
            if prefix and layer.startswith(prefix):
                layer = layer[len(prefix):]
            if prefix + layer + ".weight" in key_set:
                confs[layer] = conf
    renames: dict[str, dict[str, str]] = {}
    if not header:
        _legacy_float8(keys, prefix, read_tensor, confs, renames, plan)
    for layer, conf in confs.items():
        quant = parse_marker(layer, conf, where)
        sources = {"weight": prefix + layer + ".weight"}
        for leaf in EXTRA_TENSORS[quant.format]:
            key = renames.get(layer, {}).get(leaf, f"{prefix}{layer}.{leaf}")
            if key in key_set:
                sources[leaf] = key
        missing = [leaf for leaf in ("weight", *REQUIRED_TENSORS[quant.format])
                   if leaf not in sources or sources[leaf] not in key_set]
        if missing:
            raise ValueError(f"{where}: layer {layer!r} is marked {quant.format.value} but the file lacks "
                             f"{', '.join(f'{prefix}{layer}.{leaf}' for leaf in missing)}")
        plan.layers[layer] = quant
        plan.sources[layer] = sources
    return plan


def _legacy_float8(keys: list[str], prefix: str, read_tensor, confs: dict, renames: dict, plan: QuantPlan) -> None:
    """Layers of the old scaled-float8 form, added to `confs` (marker tensors, if any, keep precedence)."""
    marker_key = prefix + LEGACY_MARKER
    if marker_key not in keys:
        return
    marker = read_tensor(marker_key)
    fmt = WeightFormat.FLOAT8_E5M2 if marker.dtype == torch.float8_e5m2 else WeightFormat.FLOAT8_E4M3
    full_precision = marker.numel() == 2
    plan.marker_keys.add(marker_key)
    key_set = set(keys)
    for key in keys:
        if not (key.startswith(prefix) and key.endswith(".scale_weight")):
            continue
        layer = key[len(prefix):-len(".scale_weight")]
        renames[layer] = {"weight_scale": key}
        scale_input = f"{prefix}{layer}.scale_input"
        if scale_input in key_set:
            if float(read_tensor(scale_input).float().reshape(-1)[0]) == 1.0:
                plan.marker_keys.add(scale_input)  # a unit input scale means none
            else:
                renames[layer]["input_scale"] = scale_input
        if layer not in confs:
            conf = {"format": fmt.value}
            if full_precision:
                conf["full_precision_matrix_mult"] = True
            confs[layer] = conf

