"""What every stored format answers: the `QuantFormat` base class and `LayerQuant`, one layer's options.

A format's object is asked, never switched on: the marker reader asks it which options a marker
sets and which tensors a layer carries, the loader asks it whether the stored tensors fit a layer
and what float shape they stand for, models/ops.py asks it for the weight the Linear receives, the
product and the embedding lookup, and the writer and the patcher ask it to encode. The arithmetic
itself is kernels' (kernels/quantized.py, kernels/quantized_linear.py); this object is the one
place that pairs a file's tensors with it.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kernels.linear import linear
from kernels.prologues import Prologue
from kernels.quantized import QuantizedWeight, WeightFormat, embedding_rows
from kernels.quantized_linear import product_input

# safetensors' names of the dtypes stored quantized tensors may have.
STORED_DTYPES = {"I8": torch.int8, "U8": torch.uint8, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
                 "F8_E8M0": torch.float8_e8m0fnu, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass(frozen=True)
class StoredTensors:
    """The tensors a layer of one format carries beside `weight` (and `bias`), by their file leaf names."""

    required: tuple[str, ...]       # refused when a marked layer lacks one
    optional: tuple[str, ...] = ()  # read when present

    @property
    def leaves(self) -> tuple[str, ...]:
        """Every scale leaf, required first."""
        return self.required + self.optional


# Every format Weft reads, by its arithmetic; filled from the explicit list in models/quant/formats/__init__.py.
FORMATS: dict[WeightFormat, QuantFormat] = {}


@dataclass(frozen=True)
class LayerQuant:
    """How one layer's weight is stored: its format and the options its marker sets."""

    format: WeightFormat
    rotation_group: int = 0         # int8 "convrot" Hadamard group size; 0 = not rotated
    full_precision: bool = False    # `full_precision_matrix_mult`: dequantize, then a float product

    @property
    def stored_format(self) -> QuantFormat:
        """The object that reads, writes and multiplies weights in this layer's format."""
        return FORMATS[self.format]

    def marker(self) -> dict:
        """The marker JSON object ComfyUI writes for this layer (key order as ComfyUI's writer has it)."""
        return self.stored_format.marker(self)


class QuantFormat(ABC):
    """One stored format: its marker options, layout, encoding, dequantization, product and adapter side path.

    Subclasses set `arithmetic` (kernels' name of the decode; its value is the marker's "format"
    string), `code_dtypes` (safetensors dtype names the codes may have), `scales` and `embeddable`,
    and implement `encode` and `scale_elements`; the rest has a default that fits codes stored
    one per weight element.
    """

    arithmetic: WeightFormat
    code_dtypes: tuple[str, ...]
    scales: StoredTensors
    embeddable = False              # whether an Embedding table may be stored in this format
    rotates = False                 # whether a marker may ask for a Hadamard rotation ("convrot")
    writes_legacy_form = False      # whether the writer may mark it in the legacy scaled_fp8 form
    marked = True                   # whether a `.comfy_quant` marker names it (GGUF types are not marked)

    @property
    def name(self) -> str:
        """The marker's "format" string."""
        return self.arithmetic.value

    def __repr__(self) -> str:
        return f"<stored format {self.name}>"

    # -- markers -------------------------------------------------------------------------------

    def read_options(self, layer: str, conf: dict, params: dict, where: str) -> LayerQuant:
        """The options a marker object sets for `layer` (`params` is its nested "params" object, or {})."""
        if conf.get("convrot", params.get("convrot", False)):
            raise ValueError(f"{where}: layer {layer!r} asks for a convrot rotation in format {self.name!r}; "
                             "only int8_tensorwise weights are rotated")
        return LayerQuant(self.arithmetic, 0, bool(conf.get("full_precision_matrix_mult", False)))

    def marker(self, quant: LayerQuant) -> dict:
        """The marker object ComfyUI writes for a layer with these options (its key order too)."""
        conf: dict = {"format": self.name}
        if quant.full_precision:
            conf["full_precision_matrix_mult"] = True
        return conf

    def writer_options(self, in_features: int, rotation_group: int, full_precision: bool) -> LayerQuant:
        """The options the writer gives a layer of `in_features` inputs asked to rotate in groups of `rotation_group`."""
        return LayerQuant(self.arithmetic, 0, full_precision)

    # -- layout --------------------------------------------------------------------------------

    def storage_shape(self, out_features: int, in_features: int) -> tuple[int, int]:
        """Shape of the stored `weight` of an (out, in) layer."""
        return out_features, in_features

    def dense_shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        """The float weight shape a stored `weight` stands for (padding included), for config recovery."""
        return tuple(stored)

    @abstractmethod
    def scale_elements(self, leaf: str, out_features: int, in_features: int) -> tuple[int, ...]:
        """Element counts the scale tensor `leaf` of an (out, in) layer may have."""

    def check_stored(self, layer: str, quant: LayerQuant, sources: dict[str, str], out_features: int,
                     in_features: int, shapes: dict[str, tuple[int, ...]], dtypes: dict[str, str], where: str) -> None:
        """ValueError naming the file key when a layer's stored tensors do not fit an (out, in) layer."""
        weight_key = sources["weight"]
        expected = self.storage_shape(out_features, in_features)
        if tuple(shapes[weight_key]) != expected:
            raise ValueError(f"{where}: {weight_key!r} has shape {list(shapes[weight_key])}; a {self.name} layer of "
                             f"{out_features} outputs and {in_features} inputs stores {list(expected)}")
        if dtypes[weight_key] not in self.code_dtypes:
            raise ValueError(f"{where}: {weight_key!r} has dtype {dtypes[weight_key]}; {self.name} codes are stored "
                             f"as {' or '.join(self.code_dtypes)}")
        for leaf, key in sources.items():
            if leaf == "weight":
                continue
            allowed = self.scale_elements(leaf, out_features, in_features)
            count = math.prod(shapes[key])
            if count not in allowed:
                raise ValueError(f"{where}: {key!r} has shape {list(shapes[key])} ({count} values); a {self.name} "
                                 f"layer of shape ({out_features}, {in_features}) needs "
                                 f"{' or '.join(map(str, allowed))} values")

    # -- encoding ------------------------------------------------------------------------------

    @abstractmethod
    def encode(self, weight: torch.Tensor, quant: LayerQuant) -> dict[str, torch.Tensor]:
        """The stored tensors of a float (N, K) weight, by leaf name."""

    # -- reading and products ------------------------------------------------------------------

    def weight(self, tensors: dict[str, torch.Tensor], shape: tuple[int, int], quant: LayerQuant) -> QuantizedWeight:
        """The QuantizedWeight kernels receive for a layer's stored tensors (by leaf name) of float shape `shape`."""
        return QuantizedWeight(
            self.arithmetic, tensors["weight"], tensors["weight_scale"], torch.Size(shape),
            tensor_scale=tensors.get("weight_scale_2"), input_scale=tensors.get("input_scale"),
            pre_quant_scale=tensors.get("pre_quant_scale"), rotation_group=quant.rotation_group,
            full_precision=quant.full_precision)

    def linear(self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, *,
               prologue: Prologue | str | None = None, prologue_weight: torch.Tensor | None = None,
               eps: float = 1e-6, residual: torch.Tensor | None = None,
               residual_scale: torch.Tensor | float | None = None) -> torch.Tensor:
        """The unified Linear on the stored weight: kernels' registry picks the product for the format and device."""
        return linear(x, weight, bias, prologue=prologue, prologue_weight=prologue_weight, eps=eps,
                      residual=residual, residual_scale=residual_scale)

    def adapter_input(self, x: torch.Tensor, weight: QuantizedWeight, prologue: Prologue | str | None,
                      prologue_weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        """The activation the stored weight multiplies (after the prologue and any pre-scale).

        An adapter's delta is defined on the dequantized weight, so whatever multiplies that
        weight multiplies the delta too: a merged delta and a low-rank side path both read this.
        """
        return product_input(x, weight, prologue, prologue_weight, eps)

    def linear_patched(self, x: torch.Tensor, weight: QuantizedWeight, patched: torch.Tensor,
                       bias: torch.Tensor | None, *, prologue: Prologue | str | None = None,
                       prologue_weight: torch.Tensor | None = None, eps: float = 1e-6,
                       residual: torch.Tensor | None = None,
                       residual_scale: torch.Tensor | float | None = None) -> torch.Tensor:
        """The Linear with `patched` (the dequantized weight plus adapter deltas, in x's dtype) in the stored one's place."""
        if weight.pre_quant_scale is not None:
            x = self.adapter_input(x, weight, prologue, prologue_weight, eps)
            prologue = prologue_weight = None
        return linear(x, patched, bias, prologue=prologue, prologue_weight=prologue_weight, eps=eps,
                      residual=residual, residual_scale=residual_scale)

    def embedding(self, ids: torch.Tensor, weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of a table stored in this format, dequantized alone: (*ids.shape, dim)."""
        if not self.embeddable:
            raise ValueError(f"embedding tables are not read in {self.name}")
        return embedding_rows(ids, weight, dtype)
