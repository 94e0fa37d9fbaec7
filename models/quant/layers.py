"""Turning a float model built from a config into the quantized one a file describes.

`quantize_modules(model, plan, shapes, dtypes, compute_dtype, where)` replaces each layer the
QuantPlan names (an ops Linear or Embedding, built on the meta device) by its quantized twin from
models/ops.py, shaped after the file's stored tensors, after checking that those tensors fit the
layer: the codes' shape for the layer's (out, in) features and each scale's element count.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from kernels.quantized import (FLOAT8_FORMATS, MXFP8_BLOCK, NVFP4_BLOCK, WeightFormat, block_scale_shape,
                               storage_shape)
from models.quant.markers import QuantPlan

# safetensors dtype names of stored quantized tensors.
STORED_DTYPES = {"I8": torch.int8, "U8": torch.uint8, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
                 "F8_E8M0": torch.float8_e8m0fnu, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_CODE_DTYPES = {WeightFormat.INT8: ("I8",), WeightFormat.FLOAT8_E4M3: ("F8_E4M3",), WeightFormat.FLOAT8_E5M2: ("F8_E5M2",),
                WeightFormat.NVFP4: ("U8",), WeightFormat.MXFP8: ("F8_E4M3",)}


def dense_shape(fmt: WeightFormat, stored: tuple[int, ...]) -> tuple[int, ...]:
    """The float weight shape a stored `weight` stands for (padding included), for config recovery."""
    if fmt is WeightFormat.NVFP4 and len(stored) == 2:
        return stored[0], stored[1] * 2
    return tuple(stored)


def _expected_scale_elements(fmt: WeightFormat, out_features: int, in_features: int, leaf: str) -> tuple[int, ...]:
    """Element counts a scale tensor of the format may have."""
    if leaf in ("weight_scale_2", "input_scale"):
        return (1,)
    if leaf == "pre_quant_scale":
        return (in_features,)
    if fmt is WeightFormat.INT8:
        return (1, out_features)
    if fmt in FLOAT8_FORMATS:
        return (1,)
    rows, cols = storage_shape(fmt, out_features, in_features)
    if fmt is WeightFormat.NVFP4:
        return (math.prod(block_scale_shape(rows, cols * 2 // NVFP4_BLOCK)),)
    return (math.prod(block_scale_shape(rows, cols // MXFP8_BLOCK)),)


def check_stored_tensors(layer: str, plan: QuantPlan, out_features: int, in_features: int,
                         shapes: dict[str, tuple[int, ...]], dtypes: dict[str, str], where: str) -> None:
    """ValueError naming the key when a quantized layer's stored tensors do not fit an (out, in) layer."""
    quant = plan.layers[layer]
    sources = plan.sources[layer]
    fmt = quant.format
    weight_key = sources["weight"]
    expected = storage_shape(fmt, out_features, in_features)
    if tuple(shapes[weight_key]) != expected:
        raise ValueError(f"{where}: {weight_key!r} has shape {list(shapes[weight_key])}; a {fmt.value} layer of "
                         f"{out_features} outputs and {in_features} inputs stores {list(expected)}")
    if dtypes[weight_key] not in _CODE_DTYPES[fmt]:
        raise ValueError(f"{where}: {weight_key!r} has dtype {dtypes[weight_key]}; {fmt.value} codes are stored as "
                         f"{' or '.join(_CODE_DTYPES[fmt])}")
    if quant.rotation_group and in_features % quant.rotation_group:
        raise ValueError(f"{where}: layer {layer!r} has convrot_groupsize {quant.rotation_group}, which does not "
                         f"divide its {in_features} input features")
    for leaf, key in sources.items():
        if leaf == "weight":
            continue
        allowed = _expected_scale_elements(fmt, out_features, in_features, leaf)
        count = math.prod(shapes[key])
        if count not in allowed:
            raise ValueError(f"{where}: {key!r} has shape {list(shapes[key])} ({count} values); a {fmt.value} layer "
                             f"of shape ({out_features}, {in_features}) needs {' or '.join(map(str, allowed))} values")


def quantize_modules(model: nn.Module, plan: QuantPlan, shapes: dict[str, tuple[int, ...]], dtypes: dict[str, str],
                     compute_dtype: torch.dtype, where: str) -> None:
    """Replace the layers `plan` names with quantized layers shaped after the file (shapes/dtypes by file key)."""
    from models.ops import QuantizedEmbedding, QuantizedLinear
    for layer, quant in plan.layers.items():
        try:
            module = model.get_submodule(layer)
        except AttributeError:
            raise ValueError(f"{where}: quantization marker for {layer!r}, which this model does not have") from None
        sources = plan.sources[layer]
        tensor_shapes = {leaf: (tuple(shapes[key]), STORED_DTYPES[dtypes[key]]) for leaf, key in sources.items()}
        if isinstance(module, nn.Linear):
            check_stored_tensors(layer, plan, module.out_features, module.in_features, shapes, dtypes, where)
            twin = QuantizedLinear(module.in_features, module.out_features, quant, bias=module.bias is not None,
                                   tensor_shapes=tensor_shapes, compute_dtype=compute_dtype, device="meta")
        elif isinstance(module, nn.Embedding):
            if quant.format not in (WeightFormat.INT8, *FLOAT8_FORMATS):
                raise ValueError(f"{where}: embedding {layer!r} is stored as {quant.format.value}; quantized embedding "
                                 "tables are read in int8_tensorwise, float8_e4m3fn or float8_e5m2")
            check_stored_tensors(layer, plan, module.num_embeddings, module.embedding_dim, shapes, dtypes, where)
            twin = QuantizedEmbedding(module.num_embeddings, module.embedding_dim, quant,
                                      padding_idx=module.padding_idx, tensor_shapes=tensor_shapes,
                                      compute_dtype=compute_dtype, device="meta")
        else:
            raise ValueError(f"{where}: layer {layer!r} is marked {quant.format.value}, but it is a "
                             f"{type(module).__name__}; only Linear and Embedding layers are read quantized")
        parent_name, _, child = layer.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, twin)
