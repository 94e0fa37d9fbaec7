"""Every GGUF block type decodes equal to the `gguf` package's numpy reference, bit for bit.

The `gguf` package (a test extra, pinned in requirements-test.txt) is the oracle. Its numpy writer
quantizes the 32-value types; it has no numpy quantizer for the K types, so their test blocks are
random bytes with finite float16 super-block scales, which is every block a file can hold.
"""
import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")  # pinned in requirements-test.txt; never skipped there

from kernels.gguf_blocks import BLOCK_SIZES, decode_blocks  # noqa: E402
from kernels.quantized import QuantizedWeight, WeightFormat, embedding_rows  # noqa: E402

SIMPLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
K_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# Byte offsets of the float16 fields (d, dmin) inside a K block.
HALF_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _random_k_rows(type_name: str, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """Rows of random valid `type_name` blocks: random code and scale bytes, finite float16 d / dmin."""
    rng = np.random.default_rng(seed)
    _, type_size = BLOCK_SIZES[type_name]
    data = rng.integers(0, 256, size=(rows * blocks_per_row, type_size), dtype=np.uint8)
    for offset in HALF_FIELDS[type_name]:
        halves = rng.standard_normal(rows * blocks_per_row).astype(np.float32) * 0.01
        halves[:3] = (0.0, -0.0, 6.0e-8)  # zero, negative zero, a subnormal
        data[:, offset:offset + 2] = halves.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return data.reshape(rows, blocks_per_row * type_size)


def _float_rows(rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    values[1, :32] = 0.0   # an all-zero block
    values[2, 5] = 0.9     # an outlier
    values[3, :32] = 0.25  # a constant block
    return values


@pytest.mark.parametrize("type_name", SIMPLE)
@pytest.mark.parametrize("shape", [(8, 64), (5, 256)])
def test_32_value_types_decode_like_gguf(type_name, shape):
    qtype = gguf.GGMLQuantizationType[type_name]
    packed = gguf.quants.quantize(_float_rows(*shape, seed=1), qtype)  # uint8 (N, bytes per row)
    expected = gguf.quants.dequantize(packed, qtype)
    ours = decode_blocks(type_name, torch.from_numpy(packed))
    assert ours.dtype == torch.float32 and tuple(ours.shape) == shape
    assert torch.equal(ours.view(torch.int32), torch.from_numpy(expected).view(torch.int32))


@pytest.mark.parametrize("type_name", K_TYPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_k_types_decode_like_gguf(type_name, seed):
    packed = _random_k_rows(type_name, rows=6, blocks_per_row=3, seed=seed)
    expected = gguf.quants.dequantize(packed, gguf.GGMLQuantizationType[type_name])
    ours = decode_blocks(type_name, torch.from_numpy(packed))
    assert tuple(ours.shape) == (6, 3 * 256)
    # Compared as bit patterns: equal values and equal signs of zero.
    assert torch.equal(ours.view(torch.int32), torch.from_numpy(expected).view(torch.int32))


@pytest.mark.parametrize("type_name", SIMPLE + K_TYPES)
def test_quantized_weight_and_embedding_rows_use_the_block_decoder(type_name):
    fmt = WeightFormat("gguf_" + type_name.lower())
    assert fmt.gguf_type == type_name
    block_size, _ = BLOCK_SIZES[type_name]
    if type_name in SIMPLE:
        packed = gguf.quants.quantize(_float_rows(7, 2 * block_size, seed=3), gguf.GGMLQuantizationType[type_name])
    else:
        packed = _random_k_rows(type_name, rows=7, blocks_per_row=2, seed=3)
    data = torch.from_numpy(packed)
    weight = QuantizedWeight(fmt, data, data.new_empty(0), torch.Size((7, 2 * block_size)))
    dense = weight.dequantize(torch.float32)
    assert torch.equal(dense, decode_blocks(type_name, data))
    ids = torch.tensor([[6, 0], [3, 3]])
    assert torch.equal(embedding_rows(ids, weight, torch.float32), dense[ids])
    assert embedding_rows(ids, weight, torch.bfloat16).dtype == torch.bfloat16


def test_rows_that_are_not_whole_blocks_are_refused():
    with pytest.raises(ValueError, match="whole number of Q4_K blocks"):
        decode_blocks("Q4_K", torch.zeros((2, 150), dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        decode_blocks("Q8_0", torch.zeros((2, 34), dtype=torch.int8))
