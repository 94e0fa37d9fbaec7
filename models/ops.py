"""Modules whose weights reach their op through the device-memory manager.

Model code builds layers from these instead of torch.nn so that weights can live off the device
and be taken per op (see models/memory.py): each forward takes its weights (cast to the input's
dtype, adapter patches applied), runs its op and releases them. Parameter names and constructor
arguments match torch.nn (`weight`, `bias`), so checkpoint keys load by name and
`load_state_dict` works unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.conv3d import causal_conv3d
from kernels.linear import apply_prologue, linear
from kernels.prologues import Prologue
from kernels.quantized import QuantizedWeight
from kernels.norms import rms_norm
from models.memory import release, take, using, using_if_module, using_named
from models.patcher import apply_patches, patch_signature, side_entries, side_residual
from models.quant.formats import LayerQuant


class Linear(nn.Linear):
    """nn.Linear whose forward is the unified fused Linear (prologue/epilogue optional).

    `prologue_weight` may be a tensor or a module whose `weight` is the prologue's (an RMSNorm):
    a module's weight is taken through the memory manager like this layer's own. Adapter patches
    routed to the side path (models/patcher.py) run beside the product, through the epilogue's residual.
    """

    runs_adapter_side_path = True  # read by models/patcher.py when it routes an adapter's patches

    def forward(self, x: torch.Tensor, *, prologue: Prologue | str | None = None,
                prologue_weight: torch.Tensor | nn.Module | None = None, eps: float = 1e-6,
                residual: torch.Tensor | None = None,
                residual_scale: torch.Tensor | float | None = None) -> torch.Tensor:
        if isinstance(prologue_weight, nn.Module):
            with using(prologue_weight, dtype=x.dtype) as (norm_weight, _):
                return self.forward(x, prologue=prologue, prologue_weight=norm_weight, eps=eps, residual=residual,
                                    residual_scale=residual_scale)
        # take/release written out rather than `with using(...)`: this runs once per Linear per step,
        # and a resident model should pay nothing for being managed.
        weight, bias = take(self, dtype=x.dtype)
        try:
            beside = side_entries(self)
            if beside:
                x = apply_prologue(x, prologue, prologue_weight, eps)
                prologue = prologue_weight = None
                residual = side_residual(beside, x, self.out_features, residual, residual_scale)
            return linear(x, weight, bias, prologue=prologue, prologue_weight=prologue_weight, eps=eps,
                          residual=residual, residual_scale=residual_scale)
        finally:
            release(self)


class Conv1d(nn.Conv1d):
    """nn.Conv1d with weights taken per call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with using(self, dtype=x.dtype) as (weight, bias):
            return self._conv_forward(x, weight, bias)  # (B, C_out, L_out)


class ConvTranspose1d(nn.ConvTranspose1d):
    """nn.ConvTranspose1d with weights taken per call."""

    def forward(self, x: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        output_padding = self._output_padding(x, output_size, self.stride, self.padding, self.kernel_size, 1,
                                              self.dilation)
        with using(self, dtype=x.dtype) as (weight, bias):
            return F.conv_transpose1d(x, weight, bias, self.stride, self.padding, output_padding, self.groups,
                                      self.dilation)  # (B, C_out, L_out)


class Conv3d(nn.Conv3d):
    """nn.Conv3d with weights taken per call (padding as configured, like torch.nn)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with using(self, dtype=x.dtype) as (weight, bias):
            return self._conv_forward(x, weight, bias)  # (B, C_out, T', H', W')


class CausalConv3d(nn.Conv3d):
    """A causal video convolution: zeros before the first frame, reflect padding in space.

    Same parameters as nn.Conv3d (its `padding` argument is not accepted: the padding is implied by
    the kernel size). forward optionally fuses a per-frame GroupNorm + SiLU before the convolution
    and a residual add after it, through kernels/conv3d.causal_conv3d; `context` carries the last
    input frames of the previous temporal chunk so chunked encoding equals one pass.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | tuple[int, int, int],
                 stride: int | tuple[int, int, int] = 1, dilation: int | tuple[int, int, int] = 1,
                 bias: bool = True, spatial_padding: str = "reflect", device=None, dtype=None) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=0, dilation=dilation,
                         bias=bias, device=device, dtype=dtype)
        self.spatial_padding = spatial_padding

    def forward(self, x: torch.Tensor, *, norm: nn.GroupNorm | None = None, silu: bool = False,
                residual: torch.Tensor | None = None, context: torch.Tensor | None = None) -> torch.Tensor:
        with using_if_module(norm, dtype=x.dtype) as (norm_weight, norm_bias), \
                using(self, dtype=x.dtype) as (weight, bias):
            return causal_conv3d(
                x, weight, bias, stride=self.stride, dilation=self.dilation,
                num_groups=norm.num_groups if norm is not None else None,
                norm_weight=norm_weight, norm_bias=norm_bias, eps=norm.eps if norm is not None else 1e-6,
                silu=silu, spatial_padding=self.spatial_padding, residual=residual,
                context=context)  # (B, C_out, T', H', W')


class GroupNorm(nn.GroupNorm):
    """nn.GroupNorm with weights taken per call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with using(self, dtype=x.dtype) as (weight, bias):
            return F.group_norm(x, self.num_groups, weight, bias, self.eps)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm with weights taken per call (no weight/bias when elementwise_affine=False)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with using(self, dtype=x.dtype) as (weight, bias):
            return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (parameter `weight`) computed in float32, with weights taken per call; eps defaults to 1e-6."""

    def __init__(self, normalized_shape: int | list[int] | torch.Size, eps: float = 1e-6,
                 elementwise_affine: bool = True, device=None, dtype=None) -> None:
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, device=device, dtype=dtype)
        if len(self.normalized_shape) != 1:
            raise ValueError(f"RMSNorm normalises the last dimension only; got normalized_shape {self.normalized_shape}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with using(self, dtype=x.dtype) as (weight, _bias):
            return rms_norm(x, weight, self.eps)


class Embedding(nn.Embedding):
    """nn.Embedding with weights taken per call; the output is in `dtype` (default: the weights' own)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.max_norm is not None:
            # max_norm renormalises the stored weight in place, which would write into the offload copy.
            raise ValueError("Embedding(max_norm=...) is not supported: it rewrites the weights in place")

    def forward(self, ids: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        with using(self, dtype=dtype) as (weight, _bias):
            return F.embedding(ids, weight, self.padding_idx)  # (*ids.shape, embedding_dim)


# ----------------------------------------------------------------------------------------------
# Quantized layers

def input_dtype(layer: nn.Module) -> torch.dtype:
    """The float dtype to hand `layer` its input in: its weight's, or a quantized layer's compute dtype."""
    return layer.compute_dtype if getattr(layer, "holds_quantized_weights", False) else layer.weight.dtype


class QuantizedLayer(nn.Module):
    """What QuantizedLinear and QuantizedEmbedding share: stored tensors by the file's names, and decoding.

    `weight` is a frozen parameter holding the stored codes; the scales (by format: `weight_scale`,
    `weight_scale_2`, `input_scale`, `pre_quant_scale`) are buffers. The memory manager holds and
    moves them as stored (models/memory.py), and adapters add their deltas to the dequantized weight
    at take time (models/adapters), so the stored codes never change. Everything that depends on
    the format is asked of `stored_format` (models/quant/formats/).
    """

    holds_quantized_weights = True  # read by models/memory.py, models/adapters and models/patcher.py

    def __init__(self, dense_shape: tuple[int, int], quant: LayerQuant,
                 tensor_shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], compute_dtype: torch.dtype,
                 device) -> None:
        super().__init__()
        self.quant = quant
        self.stored_format = quant.stored_format
        self.compute_dtype = compute_dtype  # the dtype of outputs when the caller does not ask for one
        self._dense_shape = tuple(dense_shape)
        for name, (shape, dtype) in tensor_shapes.items():
            if name == "weight":
                self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
            else:
                self.register_buffer(name, torch.empty(shape, dtype=dtype, device=device))

    @property
    def dense_weight_shape(self) -> tuple[int, int]:
        """The shape of the float weight this layer stands for: (out, in) features or (rows, dim)."""
        return self._dense_shape

    def quantized_weight(self, tensors: dict[str, torch.Tensor] | None = None) -> QuantizedWeight:
        """The layer's QuantizedWeight over `tensors` (taken copies), or over its own tensors."""
        own = tensors if tensors is not None else dict(self.named_buffers(recurse=False), weight=self.weight)
        return self.stored_format.weight(own, self._dense_shape, self.quant)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight in `dtype`, without adapter patches."""
        return self.quantized_weight().dequantize(dtype)

    def requantized(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """The stored tensors (by name) of a float weight in this layer's format; the input's scales are kept.

        Merging an adapter into a quantized layer goes through here once, so a merged layer carries
        one more rounding than the on-the-fly path: at most half a quantization step per element of
        the stored (for int8 convrot: rotated) weight, i.e. half the row scale for int8 and half a
        unit in the last place of the scaled value for the float formats.
        """
        stored = self.stored_format.encode(weight, self.quant)
        kept = {name: tensor for name, tensor in self.named_buffers(recurse=False) if name not in stored}
        return {**kept, **stored}


class QuantizedLinear(QuantizedLayer):
    """A Linear whose weight stays quantized; its forward is its format's product on the stored weight.

    The product is the unified Linear on a QuantizedWeight, which picks a quantized product where
    one exists for the format and device and dequantize-then-matmul otherwise
    (kernels/quantized_linear.py). Adapter patches run on the side path (models/patcher.py): the
    quantized product stays, and the deltas' low-rank products on the format's `adapter_input` are
    added through the epilogue's residual. Patches that cannot run beside (DoRA) take the other
    route: the patched weight is dequantized for this op and `linear_patched` runs the float product.
    `tensor_shapes` gives each stored tensor's (shape, dtype) by leaf name, as the file has them.
    """

    runs_adapter_side_path = True  # read by models/patcher.py when it routes an adapter's patches

    def __init__(self, in_features: int, out_features: int, quant: LayerQuant, *,
                 tensor_shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], bias: bool = True,
                 compute_dtype: torch.dtype = torch.float32, device=None) -> None:
        super().__init__((out_features, in_features), quant, tensor_shapes, compute_dtype, device)
        self.in_features, self.out_features = in_features, out_features
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=compute_dtype, device=device), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor, *, prologue: Prologue | str | None = None,
                prologue_weight: torch.Tensor | nn.Module | None = None, eps: float = 1e-6,
                residual: torch.Tensor | None = None,
                residual_scale: torch.Tensor | float | None = None) -> torch.Tensor:
        with using_if_module(prologue_weight, dtype=x.dtype) as (prologue_weight, _), using_named(self) as own:
            weight = self.quantized_weight(own)
            bias = own.get("bias")
            if bias is not None:
                bias = apply_patches(self, "bias", bias.to(x.dtype))
            beside = side_entries(self)
            if beside:
                # The prologue once, for both products; the side reads what the stored weight multiplies.
                x = apply_prologue(x, prologue, prologue_weight, eps)
                prologue = prologue_weight = None
                h = self.stored_format.adapter_input(x, weight, None, None, eps)
                residual = side_residual(beside, h, self.out_features, residual, residual_scale)
            if not patch_signature(self, "weight"):
                return self.stored_format.linear(x, weight, bias, prologue=prologue, prologue_weight=prologue_weight,
                                                 eps=eps, residual=residual, residual_scale=residual_scale)
            patched = apply_patches(self, "weight", weight.dequantize(torch.float32), inplace=True).to(x.dtype)
            return self.stored_format.linear_patched(x, weight, patched, bias, prologue=prologue,
                                                     prologue_weight=prologue_weight, eps=eps, residual=residual,
                                                     residual_scale=residual_scale)


class QuantizedEmbedding(QuantizedLayer):
    """An Embedding whose table stays quantized (int8_tensorwise or float8); only looked-up rows are dequantized.

    Adapter patches on the table run on its side path (models/patcher.py): the looked-up rows get the same
    rows of each delta, computed from the adapter's factors. Patches that cannot (DoRA) dequantize the table.
    """

    runs_adapter_side_path = True  # read by models/patcher.py when it routes an adapter's patches
    side_path_reads_rows = True  # its side path adds delta rows (WeightPatch.add_side_rows), not a product

    def __init__(self, num_embeddings: int, embedding_dim: int, quant: LayerQuant, *,
                 tensor_shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], padding_idx: int | None = None,
                 compute_dtype: torch.dtype = torch.float32, device=None) -> None:
        super().__init__((num_embeddings, embedding_dim), quant, tensor_shapes, compute_dtype, device)
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx

    def forward(self, ids: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype if dtype is not None else self.compute_dtype
        with using_named(self) as own:
            weight = self.quantized_weight(own)
            if patch_signature(self, "weight"):
                table = apply_patches(self, "weight", weight.dequantize(torch.float32), inplace=True)
                return F.embedding(ids, table.to(dtype), self.padding_idx)
            beside = side_entries(self)
            if not beside:
                return self.stored_format.embedding(ids, weight, dtype)  # (*ids.shape, embedding_dim)
            # The rows and the deltas' rows summed in float32 and rounded once, as the take-time path rounds.
            rows = self.stored_format.embedding(ids, weight, torch.float32)
            for patch, strength in beside:
                patch.add_side_rows(rows, ids, strength)
            return rows.to(dtype)
