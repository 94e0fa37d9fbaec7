"""Quantized weights as the unified Linear receives them, and the arithmetic that turns them back into floats.

A `QuantizedWeight` is one layer's stored tensors (codes and scales, in the dtypes and layouts of the
file) plus what the format needs to read them; the format objects of models/quant/formats/ build it
(which file tensors a layer has, their shapes, markers and encoding are theirs, not this module's).
Here is only the arithmetic, one public decoder per format (`DECODERS`, keyed by `WeightFormat`), which
writes the stored values in float32 into a tensor it is given or a fresh one (see "Decoding" below).
`dequantize` (decode, crop, rotate back, round to a dtype) is the reference every quantized matrix
product is tested against (kernels/quantized_linear.py), whose CPU product runs the same decoders into a
reused buffer; the embedding lookup dequantizes only the rows it gathers.

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

from kernels.gguf_blocks import BLOCK_SIZES, decode_blocks


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
#
# Every decoder writes the float32 values its weight's stored tensors hold: in the stored frame (an
# int8 convrot weight still rotated) and at the stored, possibly padded, shape (`stored_shape`). It
# writes into `out` when given one (float32, that shape, contiguous) and returns it, else into a
# fresh tensor: the dequantizing CPU product (kernels/quantized_linear.py) decodes every layer into
# one reused buffer, the reference into a tensor of its own, through the same arithmetic.
#
# Codes of at most 8 bits are read through a lookup table of 256 float32 entries indexed by the code
# byte (`torch.index_select`, a gather, instead of float8 -> float32 conversion or per-nibble
# arithmetic, both several times slower on the CPU); for nvfp4 an entry is the byte's pair of E2M1
# values, high nibble first. A table entry is the value torch's own conversion gives, so the lookup
# changes no bit. The byte codes are widened to int32 indices a few rows at a time, so the index
# never costs more memory than LOOKUP_CHUNK_CODES entries.
LOOKUP_CHUNK_CODES = 1 << 18

_lookup_tables: dict[tuple[str, torch.device], torch.Tensor] = {}


def _table(kind: str, device: torch.device) -> torch.Tensor:
    """The float32 value of every code byte of `kind` (a float8 dtype's name or "e2m1_pairs"), cached per device."""
    key = (kind, device)
    table = _lookup_tables.get(key)
    if table is None:
        if kind == "e2m1_pairs":  # byte b -> (value of its high nibble, value of its low nibble)
            values = torch.tensor(E2M1_VALUES, dtype=torch.float32)
            table = torch.stack([values.repeat_interleave(16), values.repeat(16)], dim=-1)  # (256, 2)
        else:
            table = torch.arange(256, dtype=torch.uint8).view(getattr(torch, kind)).to(torch.float32)  # (256,)
        table = _lookup_tables[key] = table.to(device)
    return table


def lookup_codes(table: torch.Tensor, codes: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[r, c*E:(c+1)*E] = table[codes[r, c]]: byte codes (R, C) through a (256, E...) table into out (R, C*E)."""
    byte_codes = codes.view(torch.uint8)
    rows, width = byte_codes.shape
    entry = table[0].numel()
    if out.shape != (rows, width * entry) or out.dtype != table.dtype:
        raise ValueError(f"codes of shape {(rows, width)} decode into {table.dtype} {(rows, width * entry)}, "
                         f"got {out.dtype} {tuple(out.shape)}")
    step = max(1, LOOKUP_CHUNK_CODES // max(width, 1))
    for start in range(0, rows, step):
        index = byte_codes[start:start + step].reshape(-1).to(torch.int32)
        torch.index_select(table, 0, index, out=out[start:start + step].view(-1, *table.shape[1:]))
    return out


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

    @property
    def stored_shape(self) -> tuple[int, int]:
        """(rows, columns) of the values the stored tensors hold: `shape`, plus the block formats' padding."""
        rows, width = self.data.shape
        if self.format is WeightFormat.NVFP4:
            return rows, width * 2  # two codes per byte
        if self.format.gguf_type is not None:
            block_size, type_size = BLOCK_SIZES[self.format.gguf_type]
            return rows, width // type_size * block_size
        return rows, width

    def decode_stored(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 values at `stored_shape`, in the stored frame; into `out` when given (see "Decoding" above)."""
        decode = DECODERS.get(self.format)
        if decode is None:
            raise ValueError(f"no decoder for weight format {self.format}")
        return decode(self, out)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight of shape `shape` in `dtype` (decoded in float32, rounded once)."""
        weight = self.decode_stored()
        out_features, in_features = self.shape
        if tuple(weight.shape) != (out_features, in_features):
            weight = weight[:out_features, :in_features]  # block formats store padded rows and columns
        if self.rotation_group:  # back from the stored frame: H is symmetric and its own inverse
            weight = rotate_rows(weight, self.rotation_group)
        return weight.to(dtype)


def _output(weight: QuantizedWeight, out: torch.Tensor | None) -> torch.Tensor:
    """`out`, checked against the weight's stored shape, or a fresh float32 tensor of that shape."""
    shape = weight.stored_shape
    if out is None:
        return torch.empty(shape, dtype=torch.float32, device=weight.data.device)
    if tuple(out.shape) != shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"a {weight.format.value} weight decodes into a contiguous float32 tensor of shape {shape}, "
                         f"got {out.dtype} {tuple(out.shape)}")
    return out


def decode_int8(weight: QuantizedWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 codes * row (or tensor) scale, still rotated when the weight was stored rotated."""
    scale = weight.scale.float()
    if scale.numel() > 1:
        scale = scale.reshape(-1, 1)  # one per row, whether the file stores (N,) or (N, 1)
    return torch.mul(weight.data, scale, out=_output(weight, out))


def decode_float8(weight: QuantizedWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 codes * the tensor scale."""
    out = _output(weight, out)
    table = _table(str(FLOAT8_FORMATS[weight.format]).removeprefix("torch."), weight.data.device)
    scale = weight.scale.to(torch.float32)
    if scale.numel() == 1:  # one product per code value, not per weight: value(code) * scale, the same float32 product
        return lookup_codes(table * scale.reshape(()), weight.data, out)
    return lookup_codes(table, weight.data, out).mul_(scale)


def decode_nvfp4(weight: QuantizedWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """E2M1 values * (tensor scale * e4m3 block scale), one block per 16 columns; padded shape kept."""
    out = lookup_codes(_table("e2m1_pairs", weight.data.device), weight.data, _output(weight, out))
    rows, cols = out.shape
    blocks = unswizzle_block_scales(weight.scale.view(torch.float8_e4m3fn), rows, cols // NVFP4_BLOCK)
    scale = weight.tensor_scale.to(torch.float32) * blocks.to(torch.float32)  # (rows, cols / 16)
    out.view(rows, -1, NVFP4_BLOCK).mul_(scale.unsqueeze(-1))
    return out


def decode_mxfp8(weight: QuantizedWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 codes * 2^(e - 127), one exponent per 32 columns; padded shape kept."""
    out = lookup_codes(_table("float8_e4m3fn", weight.data.device), weight.data, _output(weight, out))
    rows, cols = out.shape
    blocks = e8m0_to_float(unswizzle_block_scales(weight.scale.view(torch.uint8), rows, cols // MXFP8_BLOCK))
    out.view(rows, -1, MXFP8_BLOCK).mul_(blocks.unsqueeze(-1))
    return out


def decode_gguf(weight: QuantizedWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 values of rows of GGUF blocks (N, bytes per row) -> (N, K), decoded on the bytes' device.

    The block arithmetic builds its values in several steps of its own, so `out` receives a copy.
    """
    values = decode_blocks(weight.format.gguf_type, weight.data)
    return values if out is None else _output(weight, out).copy_(values)


# The decoder of each stored arithmetic (float32, stored frame and shape); QuantizedWeight.dequantize
# crops and rotates back.
DECODERS = {WeightFormat.INT8: decode_int8, WeightFormat.FLOAT8_E4M3: decode_float8,
            WeightFormat.FLOAT8_E5M2: decode_float8, WeightFormat.NVFP4: decode_nvfp4,
            WeightFormat.MXFP8: decode_mxfp8,
            **{fmt: decode_gguf for fmt in WeightFormat if fmt.gguf_type is not None}}


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
