"""The GGUF block types as stored formats: one `QuantFormat` object per ggml block type.

A layer read from a GGUF file keeps its weight as the file's bytes: a uint8 `weight` of shape
(N, K / block values * block bytes), one row of blocks per output feature, with the scales inside
the blocks (no scale tensors beside it). kernels/gguf_blocks.py decodes the rows per op on the
device that holds them; the memory manager holds and moves the bytes like any other stored format.
The layers are marked by the file's tensor types (models/gguf.py builds the `QuantPlan`), never by
a `.comfy_quant` marker, so these objects are not `marked`: a safetensors marker naming one is
refused like an unknown format.

Encoding (`encode`, used when an adapter is merged into a GGUF layer and by the tiny-model
writers) exists for the 32-value types, following the `gguf` package's numpy quantizers step for
step, so both write the same bytes (tests/models/quant/test_gguf_format.py), and for Q6_K and Q4_K.
The `gguf` package has no numpy quantizer for any K type (0.19.0 raises NotImplementedError), and
llama.cpp's own C quantizers search each sub-block's scale (and min) iteratively; Weft's K encoders fit
them directly instead (Q6_K: each 16-value sub-block's largest magnitude over 31, as an int8 multiple of
a float16 super-block scale; Q4_K: each 32-value sub-block's range from min(values, 0) to its largest
value, over 15, and that min, as 6-bit multiples of the float16 d and dmin), then round each value to
the nearest code of its sub-block. The bytes are valid blocks that the `gguf` package and Weft decode
alike; they are not llama.cpp's bytes for the same weights, and the error is somewhat above what its
search reaches. Q5_K, Q3_K and Q2_K are read only; encoding one is refused with a message.
"""
from __future__ import annotations

import torch

from kernels.gguf_blocks import BLOCK_SIZES, QK_K
from kernels.quantized import QuantizedWeight, WeightFormat, embedding_rows
from models.quant.formats.base import LayerQuant, QuantFormat, StoredTensors

# The 32-value types Weft writes as the gguf package does, and the K types it writes with its own fit.
WRITABLE_TYPES = ("Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0")
K_WRITABLE_TYPES = ("Q6_K", "Q4_K")


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
    """uint8 rows of `type_name` blocks (N, K / block values * block bytes) for float rows (N, K), K a multiple
    of the block's values (32, or 256 for Q6_K and Q4_K, see `_encode_k_blocks`).

    In float32, as the `gguf` package's numpy quantizers: Q8_0 d = max|x| / 127, codes rounded half
    away from zero; Q4_0 / Q5_0 d = (signed extreme) / -8 or / -16, codes trunc(x / d + 8.5 or 16.5)
    clipped; Q4_1 / Q5_1 d = (max - min) / 15 or / 31, m = min, codes trunc((x - m) / d + 0.5) clipped.
    """
    if type_name in K_WRITABLE_TYPES:
        return _encode_k_blocks(type_name, rows)
    if type_name not in WRITABLE_TYPES:
        raise ValueError(f"Weft writes GGUF blocks of {', '.join(WRITABLE_TYPES + K_WRITABLE_TYPES)} only, not "
                         f"{type_name}; the other K types are read, not written")
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


def _codes_for(blocks: torch.Tensor, step: torch.Tensor, offset: torch.Tensor, low: int, high: int) -> torch.Tensor:
    """Each value's nearest code q in [low, high] of value = step * q - offset (step 0: code 0); int32."""
    codes = torch.round((blocks + offset) * _reciprocal(step))
    return torch.where(step == 0, torch.zeros_like(codes), codes).clamp_(low, high).to(torch.int32)


def _encode_k_blocks(type_name: str, rows: torch.Tensor) -> torch.Tensor:
    """Q6_K or Q4_K rows (module docstring: the direct fit) in kernels/gguf_blocks.py's layouts."""
    values = rows.to(torch.float32)
    count, width = values.shape
    if width % QK_K:
        raise ValueError(f"a GGUF {type_name} row holds whole blocks of {QK_K} values; {width} columns do not divide")
    blocks = values.reshape(-1, QK_K)
    n = blocks.shape[0]
    if type_name == "Q6_K":
        subs = blocks.view(n, 16, 16)
        wanted = subs.abs().amax(dim=2) / 31  # (n, 16): each sub-block's step, codes -31..31 of -32..31
        d = (wanted.amax(dim=1, keepdim=True) / 127).to(torch.float16).to(torch.float32)  # (n, 1)
        scales = torch.round(wanted * _reciprocal(d)).clamp_(-128, 127)  # (n, 16) int8 multiples of d
        step = (d * scales).unsqueeze(-1)  # (n, 16, 1)
        u = (_codes_for(subs, step, torch.zeros_like(step), -32, 31) + 32).to(torch.uint8).view(n, 2, 128)
        # ql: per half, byte b holds value b's low nibble and value 64 + b's in its high nibble;
        # qh: per half, byte c holds the top 2 bits of values c, 32 + c, 64 + c, 96 + c at bits 0, 2, 4, 6.
        ql = (u[:, :, :64] & 0x0F) | ((u[:, :, 64:] & 0x0F) << 4)
        top = (u >> 4).view(n, 2, 4, 32)
        qh = top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)
        packed = torch.cat([ql.reshape(n, 128), qh.reshape(n, 64),
                            scales.to(torch.int8).view(torch.uint8), _half_bytes(d)], dim=1)
    else:  # Q4_K
        subs = blocks.view(n, 8, 32)
        low = subs.amin(dim=2).clamp(max=0.0)  # (n, 8): the offset is subtracted, so it is never above 0
        wanted_step, wanted_min = (subs.amax(dim=2) - low) / 15, -low
        d = (wanted_step.amax(dim=1, keepdim=True) / 63).to(torch.float16).to(torch.float32)
        dmin = (wanted_min.amax(dim=1, keepdim=True) / 63).to(torch.float16).to(torch.float32)
        scales = torch.round(wanted_step * _reciprocal(d)).clamp_(0, 63)
        mins = torch.round(wanted_min * _reciprocal(dmin)).clamp_(0, 63)
        step, offset = (d * scales).unsqueeze(-1), (dmin * mins).unsqueeze(-1)
        u = _codes_for(subs, step, offset, 0, 15).to(torch.uint8).view(n, 4, 2, 32)
        codes = (u[:, :, 0] | (u[:, :, 1] << 4)).reshape(n, 128)  # per 64 values: 32 bytes, low then high nibble
        sc, mn = scales.to(torch.uint8), mins.to(torch.uint8)
        # Scales and mins 0-3 in the low 6 bits of bytes 0-3 / 4-7, whose top 2 bits carry the top bits of
        # scales / mins 4-7; bytes 8-11 hold the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high).
        scale_bytes = torch.cat([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
                                 (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)], dim=1)
        packed = torch.cat([_half_bytes(d), _half_bytes(dmin), scale_bytes, codes], dim=1)
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
