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
layer's tensors are read from. What a marker's options mean and which tensors a layer carries
are asked of the layer's format object (models/quant/formats/); this module knows only the three
forms. A marker naming a format Weft does not read is refused with the layer, the format found
and the formats supported.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from models.quant.formats import SUPPORTED_FORMATS, LayerQuant, format_named
from models.quant.formats.float8 import LEGACY_LEAVES, LEGACY_MARKER, legacy_format

MARKER_SUFFIX = ".comfy_quant"
HEADER_KEY = "_quantization_metadata"

__all__ = ["HEADER_KEY", "LEGACY_MARKER", "MARKER_SUFFIX", "SUPPORTED_FORMATS", "LayerQuant", "QuantPlan",
           "marker_bytes", "parse_marker", "read_plan"]


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
    fmt = format_named(name)
    if fmt is None:
        raise ValueError(f"{where}: layer {layer!r} is quantized in format {name!r}, which Weft does not read; "
                         f"supported formats: {', '.join(SUPPORTED_FORMATS)}")
    if conf.get("num_experts"):
        raise ValueError(f"{where}: layer {layer!r} is a {name} mixture-of-experts table (num_experts "
                         f"{conf['num_experts']}); Weft reads quantized Linear and Embedding layers only")
    return fmt.read_options(layer, conf, params, where)


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
        stored = quant.stored_format.scales
        sources = {"weight": prefix + layer + ".weight"}
        for leaf in stored.leaves:
            key = renames.get(layer, {}).get(leaf, f"{prefix}{layer}.{leaf}")
            if key in key_set:
                sources[leaf] = key
        missing = [leaf for leaf in ("weight", *stored.required) if leaf not in sources or sources[leaf] not in key_set]
        if missing:
            raise ValueError(f"{where}: layer {layer!r} is marked {quant.stored_format.name} but the file lacks "
                             f"{', '.join(f'{prefix}{layer}.{leaf}' for leaf in missing)}")
        plan.layers[layer] = quant
        plan.sources[layer] = sources
    return plan


def _legacy_float8(keys: list[str], prefix: str, read_tensor, confs: dict, renames: dict, plan: QuantPlan) -> None:
    """Layers of the legacy scaled-float8 form (models/quant/formats/float8.py), added to `confs`.

    Marker tensors, if any, keep precedence; `renames[layer]` maps the usual leaf names to the legacy keys.
    """
    marker_key = prefix + LEGACY_MARKER
    if marker_key not in keys:
        return
    fmt, full_precision = legacy_format(read_tensor(marker_key))
    plan.marker_keys.add(marker_key)
    key_set = set(keys)
    weight_scale_suffix = "." + LEGACY_LEAVES["weight_scale"]
    for key in keys:
        if not (key.startswith(prefix) and key.endswith(weight_scale_suffix)):
            continue
        layer = key[len(prefix):-len(weight_scale_suffix)]
        renames[layer] = {"weight_scale": key}
        input_scale = f"{prefix}{layer}.{LEGACY_LEAVES['input_scale']}"
        if input_scale in key_set:
            if float(read_tensor(input_scale).float().reshape(-1)[0]) == 1.0:
                plan.marker_keys.add(input_scale)  # a unit input scale means none
            else:
                renames[layer]["input_scale"] = input_scale
        if layer not in confs:
            confs[layer] = LayerQuant(fmt.arithmetic, 0, full_precision).marker()
