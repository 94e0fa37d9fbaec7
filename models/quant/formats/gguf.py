"""The GGUF block types as stored formats: one `QuantFormat` object per ggml block type.

A layer read from a GGUF file keeps its weight as the file's bytes: a uint8 `weight` of shape
(N, K / block values * block bytes), one row of blocks per output feature, with the scales inside
the blocks (no scale tensors beside it). kernels/gguf_blocks.py decodes the rows per op on the
device that holds them; the memory manager holds and moves the bytes like any other stored format.
The layers are marked by the file's tensor types (models/gguf.py builds the `QuantPlan`), never by
a `.comfy_quant` marker, so these objects are not `marked`: a safetensors marker naming one is
refused like an unknown format.

Encoding (`encode`, used when an adapter is merged into a GGUF layer and by the tiny-model
writer) exists for the 32-value types and follows the `gguf` package's numpy quantizers step for
step, so both write the same bytes (tests/models/quant/test_gguf_format.py). The K types are read
only: their quantizers search scales per sub-block and are not written here; encoding one is
refused with a message.
"""
from __future__ import annotations

import torch

from kernels.gguf_blocks import BLOCK_SIZES
from kernels.quantized import QuantizedWeight, WeightFormat, embedding_rows
from models.quant.formats.base import LayerQuant, QuantFormat, StoredTensors

# The 32-value types Weft can write, and what each block holds besides its codes.
WRITABLE_TYPES = ("Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0")


def _round_half_away(values: torch.Tensor) -> torch.Tensor:
    """Round to nearest, halves away from zero, computed as ggml's reference does (floor of twice the fraction)."""
    magnitude = values.abs()
    whole = torch.floor(magnitude)
    return torch.sign(values) * (whole + torch.floor(2 * (magnitude - whole)))


def _reciprocal(d: torch.Tensor) -> torch.Tensor:
    """1 / d, with 0 where d is 0."""
    safe = torch.where(d == 0, torch.ones_like(d), d)
    return torch.where(d == 0, torch.zeros_like(d), 1 / safe)


def _half_bytes(values: torch.Tensor) -> torch.Tensor:
    """(n, 1) float32 -> (n, 2) uint8: the little-endian float16 bytes."""
    return values.to(torch.float16).view(torch.uint8).reshape(values.shape[0], 2)


def _signed_extreme(blocks: torch.Tensor) -> torch.Tensor:
    """Each block's value of largest magnitude, with its sign (the first one on a tie): (n, 1)."""
    return torch.gather(blocks, 1, blocks.abs().argmax(dim=1, keepdim=True))


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """(n, 32) codes -> (n, 16) bytes: values 0..15 in the low nibbles, 16..31 in the high ones (bits above 4 dropped)."""
    return (codes[:, :16] & 0x0F) | ((codes[:, 16:] << 4) & 0xF0)


def _pack_fifth_bits(codes: torch.Tensor) -> torch.Tensor:
    """(n, 32) 5-bit codes -> (n, 4) bytes of their fifth bits, bit i of the little-endian word for value i."""
    bits = ((codes >> 4) & 1).view(codes.shape[0], 4, 8)
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=codes.device)
    return (bits * weights).sum(dim=-1, dtype=torch.uint8)


def encode_blocks(type_name: str, rows: torch.Tensor) -> torch.Tensor:
    """uint8 rows of `type_name` blocks (N, K / 32 * block bytes) for float rows (N, K), K a multiple of 32.

    In float32, as the `gguf` package's numpy quantizers: Q8_0 d = max|x| / 127, codes rounded half
    away from zero; Q4_0 / Q5_0 d = (signed extreme) / -8 or / -16, codes trunc(x / d + 8.5 or 16.5)
    clipped; Q4_1 / Q5_1 d = (max - min) / 15 or / 31, m = min, codes trunc((x - m) / d + 0.5) clipped.
    """
    if type_name not in WRITABLE_TYPES:
        raise ValueError(f"Weft writes GGUF blocks of {', '.join(WRITABLE_TYPES)} only, not {type_name}; "
                         "K-type files are read, not written")
    values = rows.to(torch.float32)
    count, width = values.shape
    if width % 32:
        raise ValueError(f"a GGUF {type_name} row holds whole blocks of 32 values; {width} columns do not divide")
    blocks = values.reshape(-1, 32)
    if type_name == "Q8_0":
        d = blocks.abs().amax(dim=1, keepdim=True) / 127
        codes = _round_half_away(blocks * _reciprocal(d)).to(torch.int8).view(torch.uint8)
        packed = torch.cat([_half_bytes(d), codes], dim=1)
    elif type_name in ("Q4_0", "Q5_0"):
        levels = 8 if type_name == "Q4_0" else 16
        d = _signed_extreme(blocks) / -levels
        codes = torch.trunc(blocks * _reciprocal(d) + (levels + 0.5)).clamp(0, 2 * levels - 1).to(torch.uint8)
        parts = [_half_bytes(d)] + ([_pack_fifth_bits(codes)] if type_name == "Q5_0" else []) + [_pack_nibbles(codes)]
        packed = torch.cat(parts, dim=1)
    else:  # Q4_1, Q5_1
        top = 15 if type_name == "Q4_1" else 31
        low, high = blocks.amin(dim=1, keepdim=True), blocks.amax(dim=1, keepdim=True)
        d = (high - low) / top
        codes = torch.trunc((blocks - low) * _reciprocal(d) + 0.5).clamp(0, top).to(torch.uint8)
        parts = [_half_bytes(d), _half_bytes(low)] + ([_pack_fifth_bits(codes)] if type_name == "Q5_1" else [])
        packed = torch.cat(parts + [_pack_nibbles(codes)], dim=1)
    return packed.reshape(count, -1).contiguous()


class GgufBlockFormat(QuantFormat):
    """One ggml block type: a layer's weight is its rows of blocks, decoded per op."""

    code_dtypes = ("U8",)
    scales = StoredTensors(required=())
    embeddable = True
    marked = False

    def __init__(self, arithmetic: WeightFormat) -> None:
        self.arithmetic = arithmetic
        self.type_name = arithmetic.gguf_type
        self.block_values, self.block_bytes = BLOCK_SIZES[self.type_name]

    def read_options(self, layer: str, conf: dict, params: dict, where: str) -> LayerQuant:
        raise ValueError(f"{where}: layer {layer!r} names {self.name} in a quantization marker; GGUF block types "
                         "are read from .gguf files only")

    def marker(self, quant: LayerQuant) -> dict:
        raise ValueError(f"{self.name} layers carry no quantization marker; they are written into .gguf files")

    def storage_shape(self, out_features: int, in_features: int) -> tuple[int, int]:
        return out_features, in_features // self.block_values * self.block_bytes

    def dense_shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        if len(stored) < 1:
            return tuple(stored)
        return (*stored[:-1], stored[-1] // self.block_bytes * self.block_values)

    def scale_elements(self, leaf: str, out_features: int, in_features: int) -> tuple[int, ...]:
        return ()

    def check_stored(self, layer, quant, sources, out_features, in_features, shapes, dtypes, where) -> None:
        if in_features % self.block_values:
            raise ValueError(f"{where}: {sources['weight']!r} is stored as {self.type_name}, whose blocks hold "
                             f"{self.block_values} values, but the layer has {in_features} input features")
        super().check_stored(layer, quant, sources, out_features, in_features, shapes, dtypes, where)

    def encode(self, weight: torch.Tensor, quant: LayerQuant) -> dict[str, torch.Tensor]:
        return {"weight": encode_blocks(self.type_name, weight)}

    def weight(self, tensors: dict[str, torch.Tensor], shape: tuple[int, int], quant: LayerQuant) -> QuantizedWeight:
        data = tensors["weight"]
        return QuantizedWeight(self.arithmetic, data, data.new_empty(0), torch.Size(shape))

    def embedding(self, ids: torch.Tensor, weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
        return embedding_rows(ids, weight, dtype)


# One object per block type, in WeightFormat's order (largest blocks first).
GGUF_FORMATS = tuple(GgufBlockFormat(fmt) for fmt in WeightFormat if fmt.gguf_type is not None)
GGUF_BY_TYPE = {fmt.type_name: fmt for fmt in GGUF_FORMATS}
