"""Dequantization of every stored format equals comfy-kitchen's eager reference bit for bit.

comfy-kitchen (the test extra) quantizes the weights; Weft only reads them back.
"""
import comfy_kitchen as ck
import pytest
import torch
from comfy_kitchen.backends.eager import quantization as kitchen

from kernels.quantized import (QuantizedWeight, WeightFormat, embedding_rows, hadamard, rotate_rows,
                               rotate_rows_factored, swizzle_block_scales, unswizzle_block_scales)

SHAPES = [(256, 512), (96, 64), (40, 48), (130, 32)]


def _weight(shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen) * 0.05
    w[1, :16] = 0.0  # an all-zero block
    w[2, 5] = 0.9    # an outlier
    return w


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("group", [0, 4, 16])
def test_int8_dequantization_matches_kitchen(shape, group):
    w = _weight(shape)
    with ck.use_backend("eager"):
        if group:
            q, s = kitchen.quantize_int8_convrot_weight(w, group)
            expected = kitchen.dequantize_int8_convrot_weight(q, s, group)
        else:
            q, s = kitchen.quantize_int8_rowwise(w)
            expected = kitchen.dequantize_int8_simple(q, s)
    ours = QuantizedWeight(WeightFormat.INT8, q, s, torch.Size(shape), rotation_group=group).dequantize()
    assert torch.equal(ours, expected)
    assert (ours - w).abs().max() <= s.max() * 0.5 * (1 + 1e-5) * (1 if not group else group ** 0.5)


def test_int8_tensorwise_scalar_scale_matches_kitchen():
    w = _weight((64, 48))
    with ck.use_backend("eager"):
        q, s = kitchen.quantize_int8_tensorwise(w)
        expected = kitchen.dequantize_int8_simple(q, s)
    assert s.dim() == 0
    assert torch.equal(QuantizedWeight(WeightFormat.INT8, q, s, torch.Size((64, 48))).dequantize(), expected)


def test_int8_row_scales_read_alike_as_a_column_or_a_vector():
    # A square layer, where a vector of row scales would otherwise broadcast over the columns unnoticed.
    w = _weight((48, 48))
    q, s = kitchen.quantize_int8_rowwise(w)
    as_column = QuantizedWeight(WeightFormat.INT8, q, s, torch.Size((48, 48))).dequantize()
    as_vector = QuantizedWeight(WeightFormat.INT8, q, s.reshape(-1), torch.Size((48, 48))).dequantize()
    assert torch.equal(as_vector, as_column)
    assert torch.equal(as_column, q.float() * s.reshape(-1, 1))


@pytest.mark.parametrize("shape", SHAPES)
def test_nvfp4_dequantization_matches_kitchen(shape):
    w = _weight(shape)
    tensor_scale = (w.abs().amax() / (448 * 6)).float()
    padded = shape[0] % 16 != 0 or shape[1] % 16 != 0
    with ck.use_backend("eager"):
        codes, blocks = ck.quantize_nvfp4(w, tensor_scale, pad_16x=padded)
        expected = ck.dequantize_nvfp4(codes, tensor_scale, blocks, output_type=torch.float32)
    assert blocks.shape == (-(-codes.shape[0] // 128) * 128, -(-codes.shape[1] * 2 // 16 // 4) * 4)
    # Files may store the block scales as uint8 or float8-e4m3: both read the same.
    for stored in (blocks, blocks.view(torch.uint8)):
        ours = QuantizedWeight(WeightFormat.NVFP4, codes, stored, torch.Size(shape), tensor_scale=tensor_scale)
        assert torch.equal(ours.dequantize(), expected[:shape[0], :shape[1]])


def test_nvfp4_even_element_is_the_high_nibble():
    # One byte 0x2F: high nibble 2 (value 1.0) is column 0, low nibble 0xF (value -6.0) is column 1.
    codes = torch.zeros(16, 8, dtype=torch.uint8)
    codes[0, 0] = 0x2F
    blocks = swizzle_block_scales(torch.ones(16, 1).to(torch.float8_e4m3fn))
    weight = QuantizedWeight(WeightFormat.NVFP4, codes, blocks, torch.Size((16, 16)), tensor_scale=torch.tensor(1.0))
    assert weight.dequantize()[0, :3].tolist() == [1.0, -6.0, 0.0]


@pytest.mark.parametrize("shape", [(64, 64), (96, 128), (40, 96)])
def test_mxfp8_dequantization_matches_kitchen(shape):
    w = _weight(shape)
    with ck.use_backend("eager"):
        codes, blocks = ck.quantize_mxfp8(w, pad_32x=shape[0] % 32 != 0)
        expected = ck.dequantize_mxfp8(codes, blocks, torch.float32)
    ours = QuantizedWeight(WeightFormat.MXFP8, codes, blocks.view(torch.uint8), torch.Size(shape)).dequantize()
    assert torch.equal(ours, expected[:shape[0], :shape[1]])


@pytest.mark.parametrize("dtype,fmt", [(torch.float8_e4m3fn, WeightFormat.FLOAT8_E4M3),
                                       (torch.float8_e5m2, WeightFormat.FLOAT8_E5M2)])
def test_float8_dequantization_matches_kitchen(dtype, fmt):
    w = _weight((96, 64))
    scale = (w.abs().amax() / torch.finfo(dtype).max).float()
    with ck.use_backend("eager"):
        codes = ck.quantize_per_tensor_fp8(w, scale, dtype)
        expected = ck.dequantize_per_tensor_fp8(codes, scale, torch.float32)
    assert torch.equal(QuantizedWeight(fmt, codes, scale, torch.Size((96, 64))).dequantize(), expected)


@pytest.mark.parametrize("group", [0, 16])
def test_int8_embedding_rows_match_kitchen(group):
    table = _weight((50, 32))
    ids = torch.tensor([[3, 1, 49], [0, 3, 7]])
    with ck.use_backend("eager"):
        if group:
            q, s = kitchen.quantize_int8_convrot_weight(table, group)
        else:
            q, s = kitchen.quantize_int8_rowwise(table)
        expected = kitchen.dequantize_int8_embedding(q, s, ids, group, 0)
    weight = QuantizedWeight(WeightFormat.INT8, q, s, torch.Size((50, 32)), rotation_group=group)
    assert torch.equal(embedding_rows(ids, weight, torch.float32), expected)


@pytest.mark.parametrize("rows,cols", [(128, 4), (130, 5), (3, 2), (256, 12)])
def test_block_scale_swizzle_is_the_cublas_layout(rows, cols):
    scales = torch.arange(rows * cols, dtype=torch.int32).view(rows, cols)
    swizzled = swizzle_block_scales(scales)
    padded_cols = swizzled.shape[1]
    flat = swizzled.reshape(-1)
    for r in range(rows):
        for c in range(cols):
            index = ((r // 128) * (padded_cols // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
            assert flat[index] == scales[r, c]
    assert torch.equal(unswizzle_block_scales(swizzled, rows, cols), scales)
    assert torch.equal(swizzled, ck.to_blocked(scales, flatten=False))


@pytest.mark.parametrize("size", [4, 16, 64, 256])
def test_hadamard_is_symmetric_orthogonal_and_kitchens(size):
    from comfy_kitchen.tensor.int8_utils import _build_hadamard
    h = hadamard(size)
    assert torch.equal(h, h.T)
    torch.testing.assert_close(h @ h, torch.eye(size), atol=1e-6, rtol=0)
    assert torch.equal(h, _build_hadamard(size))


@pytest.mark.parametrize("size", [2, 8, 32, 48, 128])
def test_rotation_refuses_groups_that_are_not_powers_of_4(size):
    with pytest.raises(ValueError, match="power of 4"):
        hadamard(size)


def test_rotation_applies_per_group_of_columns():
    x = torch.randn(3, 32)
    rotated = rotate_rows(x, 16)
    h = hadamard(16)
    torch.testing.assert_close(rotated[:, 16:], x[:, 16:] @ h.T)
    torch.testing.assert_close(rotate_rows(rotated, 16), x, atol=1e-6, rtol=0)


@pytest.mark.parametrize("group", [4, 16, 64, 256, 1024])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_factored_rotation_equals_the_single_product(group, dtype):
    x = torch.randn(3, 5, 2 * group, generator=torch.Generator().manual_seed(group)).to(dtype)
    expected = rotate_rows(x.float(), group)
    tolerance = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(rotate_rows_factored(x, group).float(), expected, rtol=0,
                               atol=tolerance * expected.abs().max().item())
    with pytest.raises(ValueError, match="does not divide"):
        rotate_rows_factored(torch.randn(2, group + 2), group)
