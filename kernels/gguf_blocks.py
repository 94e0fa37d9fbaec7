"""The GGUF (ggml) block types as torch arithmetic: rows of packed blocks -> float32 values.

A GGUF tensor of a quantized type is stored row by row, each row of K values cut into blocks of
`block_size` values packed into `type_size` bytes. Weft keeps the bytes as they are in the file, a
uint8 tensor (N, K / block_size * type_size), and decodes them per op on the device holding them.
Every decoder here runs in float32 with the operations in the same order as the `gguf` package's
numpy reference (`gguf.quants`), so the two agree bit for bit (tests/kernels/test_gguf_blocks.py);
the torch path exists because the numpy one is far too slow to run for every product
(bench/gguf_dequant.py measures both).

Block layouts (all multi-byte fields little-endian; d and dmin are float16; "q" are the codes):
  Q8_0  32 values, 34 bytes: d, 32 int8 q.                      value = d * q
  Q4_0  32 values, 18 bytes: d, 16 bytes of nibbles.            value = d * (q - 8)
  Q4_1  32 values, 20 bytes: d, m, 16 bytes of nibbles.         value = d * q + m
  Q5_0  32 values, 22 bytes: d, 4 bytes of fifth bits, nibbles. value = d * (q - 16)
  Q5_1  32 values, 24 bytes: d, m, fifth bits, nibbles.         value = d * q + m
        (the low nibbles of the 16 bytes are values 0..15, the high nibbles values 16..31; bit i
        of the 32-bit fifth-bit word belongs to value i)
  Q2_K  256 values, 84 bytes: 16 bytes of 4-bit scale | 4-bit min pairs (one per 16 values),
        64 bytes of 2-bit q, d, dmin.                           value = d*scale * q - dmin*min
  Q3_K  256 values, 110 bytes: 32 bytes of high bits, 64 bytes of 2-bit low q, 12 bytes of
        sixteen 6-bit scales (stored offset by 32), d.          value = d*(scale - 32) * (q - 4 if
        the high bit is clear else q)
  Q4_K  256 values, 144 bytes: d, dmin, 12 bytes of eight 6-bit scales and eight 6-bit mins
        (one pair per 32 values), 128 bytes of nibbles.         value = d*scale * q - dmin*min
  Q5_K  256 values, 176 bytes: d, dmin, the same 12 scale bytes, 32 bytes of fifth bits,
        128 bytes of nibbles.                                   value = d*scale * q - dmin*min
  Q6_K  256 values, 210 bytes: 128 bytes of low nibbles, 64 bytes of 2-bit high parts, sixteen
        int8 scales (one per 16 values), d.                     value = d*scale * (q - 32)
Within a 256-value super-block the codes are laid out in 32-value stripes: the byte at column c
of a 32-byte group holds value c of each stripe, the stripes taken by shifting 0, 2, 4, 6 (2-bit
codes), 0, 4 (nibbles) or 0..7 (single bits).
"""
from __future__ import annotations

import torch

QK_K = 256  # values per K-quant super-block

# (values per block, bytes per block), by the ggml type name.
BLOCK_SIZES: dict[str, tuple[int, int]] = {
    "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
    "Q2_K": (QK_K, 84), "Q3_K": (QK_K, 110), "Q4_K": (QK_K, 144), "Q5_K": (QK_K, 176), "Q6_K": (QK_K, 210),
}

_shift_cache: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}


def _shifts(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A uint8 tensor of bit shifts (shape (len, 1)), cached per device."""
    key = (values, device)
    cached = _shift_cache.get(key)
    if cached is None:
        cached = _shift_cache[key] = torch.tensor(values, dtype=torch.uint8, device=device).view(-1, 1)
    return cached


def _half(fields: torch.Tensor) -> torch.Tensor:
    """float32 (n, 1) of a (n, 2) uint8 slice holding one little-endian float16 per block."""
    return fields.contiguous().view(torch.float16).to(torch.float32)


def _unpack(packed: torch.Tensor, shifts: tuple[int, ...], mask: int) -> torch.Tensor:
    """(n, g, width) bytes -> (n, g, len(shifts), width) codes, each stripe shifted then masked."""
    return (packed.unsqueeze(-2) >> _shifts(shifts, packed.device)).bitwise_and_(mask)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """(n, g, width) bytes -> (n, g * 2 * width) values: low nibbles of a group first, then the high ones."""
    return _unpack(packed, (0, 4), 0x0F).reshape(packed.shape[0], -1)


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """(n, g, width) bytes -> (n, g * 8 * width) single bits, stripe by stripe."""
    return _unpack(packed, (0, 1, 2, 3, 4, 5, 6, 7), 0x01).reshape(packed.shape[0], -1)


def _bits_of_words(packed: torch.Tensor) -> torch.Tensor:
    """(n, 4) bytes of one little-endian 32-bit word per block -> (n, 32) bits, bit i at value i."""
    bits = (packed.unsqueeze(-1) >> _shifts((0, 1, 2, 3, 4, 5, 6, 7), packed.device).view(1, 1, 8)).bitwise_and_(1)
    return bits.reshape(packed.shape[0], 32)


# -- 32-value types ---------------------------------------------------------------------------

def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _half(blocks[:, :2])
    return blocks[:, 2:].view(torch.int8).to(torch.float32).mul_(d)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _half(blocks[:, :2])
    q = _nibbles(blocks[:, 2:].unsqueeze(1)).view(torch.int8).sub_(8)
    return q.to(torch.float32).mul_(d)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _half(blocks[:, :2]), _half(blocks[:, 2:4])
    q = _nibbles(blocks[:, 4:].unsqueeze(1)).to(torch.float32)
    return q.mul_(d).add_(m)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _half(blocks[:, :2])
    high = _bits_of_words(blocks[:, 2:6])
    q = _nibbles(blocks[:, 6:].unsqueeze(1)).bitwise_or_(high << 4).view(torch.int8).sub_(16)
    return q.to(torch.float32).mul_(d)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _half(blocks[:, :2]), _half(blocks[:, 2:4])
    high = _bits_of_words(blocks[:, 4:8])
    q = _nibbles(blocks[:, 8:].unsqueeze(1)).bitwise_or_(high << 4).to(torch.float32)
    return q.mul_(d).add_(m)


# -- 256-value K types ------------------------------------------------------------------------

def _k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eight 6-bit scales and eight 6-bit mins (uint8, (n, 8) each) from the 12 scale bytes of Q4_K / Q5_K.

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; scales and mins 4-7 take
    their low 4 bits from the nibbles of bytes 8-11 and their top 2 bits from the top bits of
    bytes 0-3 (scales) and 4-7 (mins).
    """
    low_scales, low_mins, rest = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([low_scales & 0x3F, (rest & 0x0F) | ((low_scales >> 2) & 0x30)], dim=-1)
    mins = torch.cat([low_mins & 0x3F, (rest >> 4) | ((low_mins >> 2) & 0x30)], dim=-1)
    return scales, mins


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales, qs = blocks[:, :16], blocks[:, 16:80]
    d, dmin = _half(blocks[:, 80:82]), _half(blocks[:, 82:84])
    dl = (d * (scales & 0x0F).to(torch.float32)).view(n, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).view(n, 16, 1)
    q = _unpack(qs.view(n, 2, 32), (0, 2, 4, 6), 0x03).reshape(n, 16, 16).to(torch.float32)
    return q.mul_(dl).sub_(ml).view(n, QK_K)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    hmask, qs, packed, d = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108], _half(blocks[:, 108:110])
    # Sixteen 6-bit scales: low 4 bits from the nibbles of bytes 0-7 (low nibbles first), top 2 bits
    # from bytes 8-11 in 2-bit stripes (scale 4 * stripe + byte).
    low = _unpack(packed[:, :8].unsqueeze(1), (0, 4), 0x0F).reshape(n, 16)
    high = _unpack(packed[:, 8:].unsqueeze(1), (0, 2, 4, 6), 0x03).reshape(n, 16)
    scales = ((low | (high << 4)).to(torch.int8) - 32).to(torch.float32)
    dl = (d * scales).view(n, 16, 1)
    q_low = _unpack(qs.view(n, 2, 32), (0, 2, 4, 6), 0x03).reshape(n, 16, 16)
    # The value is offset by -4 where the high bit is clear.
    q_high = _unpack(hmask.view(n, 1, 32), (0, 1, 2, 3, 4, 5, 6, 7), 0x01).reshape(n, 16, 16) ^ 1
    q = q_low.view(torch.int8).sub_(q_high.bitwise_left_shift_(2).view(torch.int8)).to(torch.float32)
    return q.mul_(dl).view(n, QK_K)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = _half(blocks[:, :2]), _half(blocks[:, 2:4])
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    dl = (d * scales.to(torch.float32)).view(n, 8, 1)
    ml = (dmin * mins.to(torch.float32)).view(n, 8, 1)
    q = _nibbles(blocks[:, 16:].view(n, 4, 32)).view(n, 8, 32).to(torch.float32)
    return q.mul_(dl).sub_(ml).view(n, QK_K)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = _half(blocks[:, :2]), _half(blocks[:, 2:4])
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    dl = (d * scales.to(torch.float32)).view(n, 8, 1)
    ml = (dmin * mins.to(torch.float32)).view(n, 8, 1)
    high = _bits(blocks[:, 16:48].view(n, 1, 32)).view(n, 8, 32)
    q = _nibbles(blocks[:, 48:].view(n, 4, 32)).view(n, 8, 32).bitwise_or_(high.bitwise_left_shift_(4))
    return q.to(torch.float32).mul_(dl).sub_(ml).view(n, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = _half(blocks[:, 208:210])
    dl = (d * scales).view(n, 16, 1)
    low = _unpack(ql.view(n, 2, 64), (0, 4), 0x0F).reshape(n, 8, 32)
    high = _unpack(qh.view(n, 2, 32), (0, 2, 4, 6), 0x03).reshape(n, 8, 32)
    q = low.bitwise_or_(high.bitwise_left_shift_(4)).view(torch.int8).sub_(32).view(n, 16, 16).to(torch.float32)
    return q.mul_(dl).view(n, QK_K)


_BLOCK_DECODERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
                   "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def decode_blocks(type_name: str, rows: torch.Tensor) -> torch.Tensor:
    """float32 values of GGUF rows of `type_name` blocks: uint8 (..., bytes per row) -> (..., values per row)."""
    block_size, type_size = BLOCK_SIZES[type_name]
    if rows.dtype != torch.uint8:
        raise ValueError(f"GGUF {type_name} blocks are read from uint8 bytes, got {rows.dtype}")
    if rows.shape[-1] % type_size:
        raise ValueError(f"a row of {rows.shape[-1]} bytes is not a whole number of {type_name} blocks "
                         f"({type_size} bytes each)")
    lead = rows.shape[:-1]
    blocks = rows.reshape(-1, type_size)
    values = _BLOCK_DECODERS[type_name](blocks)  # (blocks, block_size)
    return values.reshape(*lead, rows.shape[-1] // type_size * block_size)
