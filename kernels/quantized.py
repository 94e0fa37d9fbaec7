"""Quantized weights as the unified Linear receives them, and the arithmetic that turns them back into floats.

A `QuantizedWeight` is one layer's stored tensors (codes and scales, in the dtypes and layouts of the
file) plus what the format needs to read them; the format objects of models/quant/formats/ build it
(which file tensors a layer has, their shapes, markers and encoding are theirs, not this module's).
Here is only the arithmetic, one public decoder per format (`DECODERS`, keyed by `WeightFormat`).
`dequantize` is the reference every quantized matrix product is tested against
(kernels/quantized_linear.py); the embedding lookup dequantizes only the rows it gathers.

The formats (storage for a logical weight of shape (N, K)):
  int8_tensorwise  int8 codes (N, K); `scale` float32, one per row (N, 1) or one for the tensor;
                   W = codes * scale. With a rotation group G (`rotation_group`), the stored rows are
                   W @ blockdiag(H) for the regular normalized Hadamard H of size G (a power of 4),
                   and W is recovered by multiplying the dequantized groups by H again (H is
                   symmetric and its own inverse).
  float8_e4m3fn /  float8 codes (N, K); `scale` a float32 scalar; W = codes * scale.
  float8_e5m2
  nvfp4            E2M1 codes two per byte (N, K/2), the even column in the high nibble; `scale`
                   float8-e4m3 block scales, one per 16 columns, in the 128x4 swizzled layout;
                   `tensor_scale` a float32 scalar; W = value(code) * (tensor_scale * block_scale).
  mxfp8            float8-e4m3 codes (N, K); `scale` E8M0 exponents (uint8), one per 32 columns, in
                   the 128x4 swizzled layout; W = codes * 2^(e - 127), e = 0 meaning zero.
  gguf_*           the GGUF block types (Q8_0, Q6_K, Q5_K, Q5_1, Q5_0, Q4_K, Q4_1, Q4_0, Q3_K, Q2_K):
                   the file's bytes as uint8 rows (N, K / block values * block bytes), scales
                   inside the blocks (`scale` is unused); decoded by kernels/gguf_blocks.py, which
                   agrees with the `gguf` package's numpy reference bit for bit.
nvfp4 and mxfp8 storage may be padded (rows and columns to 16 or 32); dequantize crops to `shape`.
The arithmetic order of every decode matches comfy-kitchen's eager reference, so dequantized
weights agree with it bit for bit (tests/kernels/test_quantized.py).
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

from kernels.gguf_blocks import decode_blocks


class WeightFormat(enum.Enum):
    """The stored formats; the value is the `format` string of a layer's quantization marker."""

    INT8 = "int8_tensorwise"
    FLOAT8_E4M3 = "float8_e4m3fn"
    FLOAT8_E5M2 = "float8_e5m2"
    NVFP4 = "nvfp4"
    MXFP8 = "mxfp8"
    # GGUF block types (kernels/gguf_blocks.py). Their layers are marked by the GGUF file's tensor
    # types, never by a `.comfy_quant` marker; the value names the ggml type after the prefix.
    GGUF_Q8_0 = "gguf_q8_0"
    GGUF_Q6_K = "gguf_q6_k"
    GGUF_Q5_K = "gguf_q5_k"
    GGUF_Q5_1 = "gguf_q5_1"
    GGUF_Q5_0 = "gguf_q5_0"
    GGUF_Q4_K = "gguf_q4_k"
    GGUF_Q4_1 = "gguf_q4_1"
    GGUF_Q4_0 = "gguf_q4_0"
    GGUF_Q3_K = "gguf_q3_k"
    GGUF_Q2_K = "gguf_q2_k"

    @property
    def gguf_type(self) -> str | None:
        """The ggml type name of a GGUF block format ("Q4_K"), None for the other formats."""
        return self.value[len(GGUF_PREFIX):].upper() if self.value.startswith(GGUF_PREFIX) else None


GGUF_PREFIX = "gguf_"


FLOAT8_FORMATS = {WeightFormat.FLOAT8_E4M3: torch.float8_e4m3fn, WeightFormat.FLOAT8_E5M2: torch.float8_e5m2}
NVFP4_BLOCK = 16
MXFP8_BLOCK = 32
# The value of each 4-bit E2M1 code; bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def round_up(value: int, multiple: int) -> int:
    """`value` rounded up to a multiple of `multiple`."""
    return -(-value // multiple) * multiple


def block_scale_shape(rows: int, blocks_per_row: int) -> tuple[int, int]:
    """Shape of swizzled block scales for `rows` rows of `blocks_per_row` blocks: (128-row tiles, 4-column tiles)."""
    return round_up(rows, 128), round_up(blocks_per_row, 4)


# ----------------------------------------------------------------------------------------------
# The 128x4 swizzled ("blocked") layout of block scales
#
# The padded (R, C) scale matrix is cut into tiles of 128 rows x 4 columns, stored tile after tile
# (row-major over tiles). Inside a tile, row r = 32 * i + j (i < 4, j < 32) and column c land at
# offset 16 * j + 4 * i + c: the four 32-row bands are interleaved column-wise.

def swizzle_block_scales(scales: torch.Tensor) -> torch.Tensor:
    """(rows, blocks) scales -> the padded swizzled tensor of shape block_scale_shape(rows, blocks)."""
    rows, cols = scales.shape
    padded_rows, padded_cols = block_scale_shape(rows, cols)
    padded = scales.new_zeros((padded_rows, padded_cols))
    padded[:rows, :cols] = scales
    tiles = padded.view(padded_rows // 128, 4, 32, padded_cols // 4, 4)  # (tile row, i, j, tile col, c)
    return tiles.permute(0, 3, 2, 1, 4).reshape(padded_rows, padded_cols).contiguous()


def unswizzle_block_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The (rows, cols) scales held by a swizzled tensor (inverse of swizzle_block_scales, then cropped)."""
    padded_rows, padded_cols = block_scale_shape(rows, cols)
    if swizzled.numel() != padded_rows * padded_cols:
        raise ValueError(f"swizzled block scales hold {swizzled.numel()} values; {rows} rows of {cols} blocks "
                         f"need {padded_rows} x {padded_cols}")
    tiles = swizzled.reshape(padded_rows // 128, padded_cols // 4, 32, 4, 4)  # (tile row, tile col, j, i, c)
    return tiles.permute(0, 3, 2, 1, 4).reshape(padded_rows, padded_cols)[:rows, :cols]


# ----------------------------------------------------------------------------------------------
# Rotation (int8 "convrot")

_hadamards: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}


def is_power_of_4(size: int) -> bool:
    """True for 4, 16, 64, 256, ...: the group sizes the regular Hadamard rotation exists for."""
    return size >= 4 and size & (size - 1) == 0 and (size.bit_length() - 1) % 2 == 0


def hadamard(size: int, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The regular normalized Hadamard matrix of order `size` (a power of 4): Kronecker powers of a 4x4 seed.

    Every entry is +-1/sqrt(size), a power of two, so the matrix is exact in any float dtype.
    """
    if not is_power_of_4(size):
        raise ValueError(f"rotation group size must be a power of 4 (4, 16, 64, 256, ...), got {size}")
    key = (size, torch.device(device), dtype)
    cached = _hadamards.get(key)
    if cached is None:
        seed = torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], dtype=torch.float32)
        matrix = seed
        while matrix.shape[0] < size:
            matrix = torch.kron(matrix, seed)
        cached = _hadamards[key] = (matrix / math.sqrt(size)).to(device=device, dtype=dtype)
    return cached


def rotate_rows(rows: torch.Tensor, group: int) -> torch.Tensor:
    """Each row's consecutive groups of `group` columns multiplied by H^T (H = hadamard(group)); shape kept.

    Works for weights (N, K) and activations (..., K); H is built in the rows' dtype.
    """
    features = rows.shape[-1]
    if features % group:
        raise ValueError(f"rotation group {group} does not divide the {features} columns")
    h = hadamard(group, device=rows.device, dtype=rows.dtype)
    grouped = rows.reshape(-1, features // group, group)
    return torch.matmul(grouped, h.T).reshape(rows.shape)


# Measured on a 2-core AVX2 AMD EPYC, float32, 1,060 rows, one thread: group 256 (3,584 columns)
# 34 ms -> 11 ms factored; groups 16 and 64 (1,344 columns) 4 ms -> 16-23 ms, so they keep one product.
FACTORED_ROTATION_MIN_GROUP = 256


def rotate_rows_factored(rows: torch.Tensor, group: int) -> torch.Tensor:
    """rotate_rows(rows, group) through two small products instead of one: same values up to float rounding.

    hadamard(G) is a Kronecker power of the 4x4 seed, so it splits as hadamard(a) (x) hadamard(b) with
    a * b = G. Seen as an (a, b) matrix V (column c of the group at row c // b, column c % b), a
    group's rotation H v is then hadamard(a) @ V @ hadamard(b).T: 2 (a + b) multiply-adds per value
    instead of 2 G (for G = 256: 64 instead of 512). Below FACTORED_ROTATION_MIN_GROUP the small
    batched products cost more than they save, and `rotate_rows` runs instead. The dequantizing int8
    product rotates its activation this way; decoding a weight keeps `rotate_rows`, whose summation
    order matches comfy-kitchen's reference bit for bit.
    """
    features = rows.shape[-1]
    if features % group:
        raise ValueError(f"rotation group {group} does not divide the {features} columns")
    if group < FACTORED_ROTATION_MIN_GROUP:
        return rotate_rows(rows, group)
    power = group.bit_length() // 2  # group = 4 ** power
    outer = 4 ** (power // 2)
    inner = group // outer
    h_outer = hadamard(outer, device=rows.device, dtype=rows.dtype)
    h_inner = hadamard(inner, device=rows.device, dtype=rows.dtype)
    grouped = rows.reshape(-1, outer, inner)  # (groups of all rows, a, b)
    return torch.matmul(torch.matmul(h_outer, grouped), h_inner.T).reshape(rows.shape)


# ----------------------------------------------------------------------------------------------
# Decoding

def decode_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """float32 values of packed E2M1 codes (..., K/2) -> (..., K); the even column is the high nibble."""
    high = packed >> 4
    low = packed & 0x0F
    codes = torch.stack([high, low], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    return table[codes.long()]


def e8m0_to_float(exponents: torch.Tensor) -> torch.Tensor:
    """float32 2^(e - 127) of uint8 E8M0 exponents, with e = 0 read as zero."""
    bits = exponents.to(torch.int32) << 23
    return torch.where(exponents == 0, torch.zeros_like(bits), bits).view(torch.float32)


@dataclass(frozen=True)
class QuantizedWeight:
    """One layer's stored weight tensors and how to read them (see the module docstring)."""

    format: WeightFormat
    data: torch.Tensor                      # codes as stored
    scale: torch.Tensor                     # the file's `weight_scale`
    shape: torch.Size                       # logical (out_features, in_features)
    tensor_scale: torch.Tensor | None = None     # nvfp4 `weight_scale_2`
    input_scale: torch.Tensor | None = None      # float8 / nvfp4 `input_scale`
    pre_quant_scale: torch.Tensor | None = None  # nvfp4 `pre_quant_scale`: multiplies the input per column
    rotation_group: int = 0                 # int8 only: Hadamard group size, 0 when not rotated
    full_precision: bool = False            # only the dequantize-then-matmul reference may run

    def dim(self) -> int:
        """2, as for the float weight this stands for."""
        return 2

    @property
    def device(self) -> torch.device:
        """Where the stored tensors are."""
        return self.data.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight of shape `shape` in `dtype` (decoded in float32, rounded once)."""
        decode = DECODERS.get(self.format)
        if decode is None:
            raise ValueError(f"no decoder for weight format {self.format}")
        weight = decode(self)
        out_features, in_features = self.shape
        if tuple(weight.shape) != (out_features, in_features):
            weight = weight[:out_features, :in_features]  # block formats store padded rows and columns
        return weight.to(dtype)


def dequantize_int8(weight: QuantizedWeight) -> torch.Tensor:
    """float32 codes * row (or tensor) scale, rotated back when the weight was stored rotated."""
    values = weight.data.float() * weight.scale.float()
    return rotate_rows(values, weight.rotation_group) if weight.rotation_group else values


def dequantize_float8(weight: QuantizedWeight) -> torch.Tensor:
    """float32 codes * the tensor scale."""
    return weight.data.to(torch.float32) * weight.scale.to(torch.float32)


def dequantize_nvfp4(weight: QuantizedWeight) -> torch.Tensor:
    """E2M1 values * (tensor scale * e4m3 block scale), one block per 16 columns; padded shape kept."""
    values = decode_e2m1(weight.data)  # (rows, cols) padded
    rows, cols = values.shape
    blocks = unswizzle_block_scales(weight.scale.view(torch.float8_e4m3fn), rows, cols // NVFP4_BLOCK)
    scale = weight.tensor_scale.to(torch.float32) * blocks.to(torch.float32)  # (rows, cols / 16)
    return (values.view(rows, -1, NVFP4_BLOCK) * scale.unsqueeze(-1)).view(rows, cols)


def dequantize_mxfp8(weight: QuantizedWeight) -> torch.Tensor:
    """float32 codes * 2^(e - 127), one exponent per 32 columns; padded shape kept."""
    rows, cols = weight.data.shape
    blocks = e8m0_to_float(unswizzle_block_scales(weight.scale.view(torch.uint8), rows, cols // MXFP8_BLOCK))
    return (weight.data.to(torch.float32).view(rows, -1, MXFP8_BLOCK) * blocks.unsqueeze(-1)).view(rows, cols)


def dequantize_gguf(weight: QuantizedWeight) -> torch.Tensor:
    """float32 values of rows of GGUF blocks (N, bytes per row) -> (N, K), decoded on the bytes' device."""
    return decode_blocks(weight.format.gguf_type, weight.data)


# The decoder of each stored arithmetic (float32, possibly padded); QuantizedWeight.dequantize crops.
DECODERS = {WeightFormat.INT8: dequantize_int8, WeightFormat.FLOAT8_E4M3: dequantize_float8,
            WeightFormat.FLOAT8_E5M2: dequantize_float8, WeightFormat.NVFP4: dequantize_nvfp4,
            WeightFormat.MXFP8: dequantize_mxfp8,
            **{fmt: dequantize_gguf for fmt in WeightFormat if fmt.gguf_type is not None}}


def embedding_rows(ids: torch.Tensor, weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of a quantized embedding table, gathered first and dequantized alone: (*ids.shape, dim)."""
    fmt = weight.format
    if fmt.gguf_type is not None:  # GGUF rows are whole blocks: gather the rows' bytes, decode only those
        return decode_blocks(fmt.gguf_type, weight.data[ids])[..., :weight.shape[1]].to(dtype)
    if fmt not in (WeightFormat.INT8, *FLOAT8_FORMATS):
        raise ValueError(f"embedding tables are read in int8_tensorwise or float8 only, not {fmt.value}")
    rows = weight.data[ids].to(torch.float32)
    scale = weight.scale.to(torch.float32)
    rows = rows * (scale[ids] if scale.dim() >= 2 and scale.shape[0] > 1 else scale.reshape(()))
    if weight.rotation_group:
        rows = rotate_rows(rows.reshape(-1, rows.shape[-1]), weight.rotation_group).reshape(rows.shape)
    return rows.to(dtype)
